"""``portarl parity`` and ``portarl parity compare``: reports, tables, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from portarl.cli import main
from portarl.parity.report import compare_reports, read_report


@pytest.fixture(scope="module")
def report_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("parity") / "cpu.json"
    code = main(["parity", "--device", "cpu", "--backends", "reference", "--dtypes", "fp32", "bf16", "--out", str(path)])
    assert code == 0
    return path


def test_report_contents(report_path):
    report = read_report(report_path)
    assert report["device"] == "cpu" and report["primary_backend"] == "reference" and report["passed"]
    env = report["environment"]
    for key in ("torch", "triton", "cuda", "nvidia_driver", "torch_npu", "cann", "npu_driver", "device_name", "python"):
        assert key in env
    results = report["results"]
    cases = {r["case"] for r in results}
    assert {"v152064", "sliced", "magnitude_1e4", "kl_extreme/k3"} <= cases
    assert {r["dtype"] for r in results} == {"fp32", "bf16"}
    for r in results:
        assert r["passed"] and r["max_abs"] is not None and r["atol"] is not None and r["forward_ms"] is not None
        assert len(r["sample_index"]) == len(r["sample_values"]) > 0


def test_compare_identical_reports_passes(report_path, capsys):
    assert main(["parity", "compare", str(report_path), str(report_path)]) == 0
    assert "cases agree" in capsys.readouterr().out


def test_compare_fails_when_devices_differ(report_path, tmp_path, capsys):
    report = json.loads(report_path.read_text())
    row = next(r for r in report["results"] if r["case"] == "v4099_batched" and r["quantity"] == "logp" and r["dtype"] == "fp32")
    row["sample_values"][0] = float(row["sample_values"][0]) + 50 * row["atol"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps(report))
    assert main(["parity", "compare", str(report_path), str(other)]) == 1
    out = capsys.readouterr().out
    assert "devices differ by more than the tolerance" in out and "1 FAILED" in out


def test_compare_fails_when_a_report_exceeds_tolerance(report_path, tmp_path, capsys):
    report = json.loads(report_path.read_text())
    report["results"][0]["passed"] = False
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(report))
    assert main(["parity", "compare", str(bad), str(report_path)]) == 1
    assert "A exceeds tolerance" in capsys.readouterr().out


def test_compare_fails_on_missing_cases(report_path, tmp_path, capsys):
    report = json.loads(report_path.read_text())
    report["results"] = [r for r in report["results"] if r["case"] != "neg_inf"]
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(report))
    assert main(["parity", "compare", str(report_path), str(partial)]) == 1
    assert "missing in report B" in capsys.readouterr().out


def test_compare_bad_files(tmp_path, report_path, capsys):
    assert main(["parity", "compare", str(tmp_path / "nope.json"), str(report_path)]) == 2
    junk = tmp_path / "junk.json"
    junk.write_text("{}")
    assert main(["parity", "compare", str(junk), str(report_path)]) == 2
    assert "not a portarl.parity/1 parity report" in capsys.readouterr().err


def test_absent_device_exits_2(capsys):
    assert main(["parity", "--device", "npu"]) == 2
    assert "torch_npu" in capsys.readouterr().err


def test_unusable_backend_exits_2(capsys):
    assert main(["parity", "--device", "cpu", "--backends", "npu"]) == 2
    assert "cannot run on cpu" in capsys.readouterr().err


def test_interpreted_triton_sweep_in_a_fresh_process(tmp_path):
    """As `make demo` runs it on a CPU machine: the CLI itself turns on the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "triton.json"
    proc = subprocess.run(
        [sys.executable, "-m", "portarl", "parity", "--device", "cpu", "--backends", "cuda", "--dtypes", "bf16", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = read_report(out)
    assert report["environment"]["triton_interpreter"] is True
    # Labelled as what ran (issue 33 item 13): the kernels' arithmetic in the interpreter, not a GPU.
    assert {r["backend"] for r in report["results"]} == {"cuda-interpreted"}
    assert "checks within tolerance" in proc.stdout and "cuda-interpreted" in proc.stdout
    rows = compare_reports(report, report, "cuda", "cuda-interpreted")  # the backend's name selects them too
    assert rows and all(row.passed and row.a.backend == "cuda-interpreted" for row in rows)


def test_compare_shows_the_full_tolerance_applied(report_path, capsys):
    """Issue 13 item 10: atol and rtol, the larger of the two reports' (what the check uses)."""
    from portarl.parity.report import compare_reports, read_report

    assert main(["parity", "compare", str(report_path), str(report_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("dtype"))
    assert header.split()[-3:] == ["atol", "rtol", "status"]
    assert any("atol + rtol" in line for line in out)
    report = read_report(report_path)
    row = next(c for c in compare_reports(report, report) if c.a.rtol)
    op, case, dtype, qty = row.key
    line = next(line for line in out if line.split()[:4] == [dtype, op, case, qty])
    assert line.split()[-3:-1] == [format(row.a.atol, ".2e"), format(row.a.rtol, ".2e")]
