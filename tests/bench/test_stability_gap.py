"""The mean relative loss gap (the Ascend community's 2% acceptance) on hand-made metrics, its
line under each verdict, and stability directories travelling as one .tar: round trip and
refusal of an unsafe archive. No training: the run directories are written by hand."""

from __future__ import annotations

import io
import json
import math
import tarfile
import tempfile
from pathlib import Path

import pytest

from portarl.bench.stability.analysis import analyse
from portarl.bench.stability.archive import UnsafeArchive, open_record, pack_record
from portarl.bench.stability.loss_gap import ASCEND_LOSS_GAP_LIMIT, mean_relative_loss_gap
from portarl.bench.stability.record import FORMAT, RunResult
from portarl.bench.stability.runs import RunSpec
from portarl.cli import main

NAN = float("nan")
RULE = "(Ascend community acceptance: < 2%, verl PR #332 / OpenRLHF PR #605)"
# Baseline loss per step: step 3 is exactly 0 and step 4 is 1e-7 (both below the 1e-6 floor:
# left out), step 6 is NaN in the baseline (not compared), step 7 is one the runs never reach.
BASE = [0.5, -0.2, 0.0, 1e-7, 0.4, NAN, 0.3]


def _rows(losses, key="loss"):
    return [{"step": i, key: v, "pg/loss": v, "kl": 0.1, "reward/mean": 0.5, "grad_norm": 1.0, "entropy": 2.0,
             "skipped": 0} for i, v in enumerate(losses, start=1)]


def _result(label, losses, key="loss"):
    return RunResult(RunSpec.from_label(label), _rows(losses, key), [], None, "CPU", steps=len(losses))


def test_gap_on_hand_made_losses():
    base = _result("cpu:fp32", BASE)
    close = _result("cpu:bf16", [0.505, -0.201, 0.3, 2e-7, 0.404, 0.4])
    g = mean_relative_loss_gap(base, close)
    # steps 1, 2, 5: |0.505-0.5|/0.5 = 0.01, |-0.201+0.2|/0.2 = 0.005, |0.404-0.4|/0.4 = 0.01
    assert g["mean_relative_gap"] == pytest.approx((0.01 + 0.005 + 0.01) / 3)
    assert (g["metric"], g["steps_compared"], g["passes"]) == ("loss", 3, True)
    assert g["near_zero_steps"] == [3, 4] and g["baseline_nonfinite_steps"] == [6] and g["missing_steps"] == [7]
    assert g["nonfinite_steps"] == [] and g["limit"] == ASCEND_LOSS_GAP_LIMIT == 0.02
    assert g["line"] == (f"mean relative loss gap 0.833% over 3 steps {RULE}: passes; 2 steps with |baseline loss| "
                         "< 1e-06 left out (3-4); baseline loss non-finite at steps 6 (not compared); steps 7 not "
                         "reached by the run (not compared)")

    far = _result("cpu:fp16", [0.51, -0.19, 0.0, 0.0, 0.38, 0.3, 0.3])
    g = mean_relative_loss_gap(base, far)  # steps 1, 2, 5, 7: 0.02, 0.05, 0.05, 0: 3%
    assert g["mean_relative_gap"] == pytest.approx(0.03) and g["passes"] is False
    assert g["line"].startswith(f"mean relative loss gap 3% over 4 steps {RULE}: FAILS") and g["missing_steps"] == []


def test_a_nonfinite_loss_in_the_run_is_not_averaged_away():
    base = _result("cpu:fp32", BASE)
    rows = _rows([0.505, NAN, 0.0, 0.0, 0.404, 0.3, 0.3])
    del rows[6]["loss"]  # step 7 logged no loss (a skipped step)
    run = RunResult(RunSpec.from_label("npu:bf16"), rows, [], None, "NPU", steps=7)
    g = mean_relative_loss_gap(base, run)
    assert math.isnan(g["mean_relative_gap"]) and g["passes"] is False
    assert g["nonfinite_steps"] == [2, 7] and g["steps_compared"] == 2
    assert g["mean_relative_gap_finite_steps"] == pytest.approx(0.01)  # steps 1 and 5: 0.01 each
    assert g["line"].startswith(f"mean relative loss gap non-finite over 4 steps {RULE}: FAILS (loss NaN/inf or "
                                "not logged in the run at steps 2, 7; over the 2 finite steps: 1%)")


def test_gap_falls_back_to_the_policy_loss_and_says_so():
    base, run = _result("cpu:fp32", [0.5], key="pg/loss"), _result("cpu:bf16", [0.5], key="pg/loss")
    for r in (base, run):
        for row in r.rows:
            row.pop("loss", None)
    g = mean_relative_loss_gap(base, run)
    assert g["metric"] == "pg/loss" and g["mean_relative_gap"] == 0.0
    assert g["line"].startswith("mean relative loss gap (pg/loss) 0% over 1 step ")
    zero = mean_relative_loss_gap(_result("cpu:fp32", [0.0]), _result("cpu:bf16", [0.1]))
    assert zero["passes"] is None and "no step to compare" in zero["line"] and zero["near_zero_steps"] == [1]


def test_gap_sits_in_the_analysis_without_changing_the_verdict():
    base = _result("cpu:fp32", BASE)
    far = _result("cpu:fp16", [0.51, -0.19, 0.0, 0.0, 0.38, 0.3, 0.3])
    result = analyse([base, far], 1e9)
    assert result["parted"] == [] and result["loss_gap_failed"] == ["cpu:fp16"]
    assert result["runs"][0]["loss_gap"] is None and result["runs"][1]["loss_gap"]["passes"] is False


# ---- run directories written by hand ----
def _write_dir(root: Path, runs: dict[str, list[float]]) -> Path:
    root.mkdir(parents=True)
    specs = [RunSpec.from_label(label) for label in runs]
    (root / "manifest.json").write_text(json.dumps({
        "format": FORMAT, "steps": 7, "seed": 0, "threshold": 0.1, "recording": None, "replayed_from": None,
        "runs": [{"label": s.label, "slug": s.slug} for s in specs]}))
    for spec, losses in zip(specs, runs.values()):
        d = root / "runs" / spec.slug
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"label": spec.label, "steps": len(losses),
                                                "environment": {"device_name": "CPU"}}))
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(losses)))
    return root


@pytest.fixture
def two_machines(tmp_path):
    gpu = _write_dir(tmp_path / "gpu", {"cpu:fp32": BASE})
    npu = _write_dir(tmp_path / "npu", {"cpu:bf16": [0.505, -0.201, 0.3, 2e-7, 0.404, 0.4, 0.3],
                                        "cpu:fp16": [0.51, -0.19, 0.0, 0.0, 0.38, 0.3, 0.3]})
    return gpu, npu


def _json_without_sources(report_dir: Path) -> dict:
    data = json.loads((report_dir / "stability.json").read_text())
    for run in data["runs"]:
        run.pop("source")
    return data


def test_compare_prints_the_gap_under_each_verdict(two_machines, tmp_path, capsys):
    gpu, npu = two_machines
    out = tmp_path / "report"
    # A failing gap does not change the exit status: the curve verdicts (threshold 1e9: none parts) decide.
    assert main(["bench", "stability", "compare", str(gpu), str(npu), "--out", str(out), "--threshold", "1e9"]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("cpu:bf16: tracks cpu:fp32"))
    # steps 1, 2, 5, 7: 0.01, 0.005, 0.01, 0
    assert lines[i + 1] == f"  cpu:bf16: mean relative loss gap 0.625% over 4 steps {RULE}: passes; " \
                           "2 steps with |baseline loss| < 1e-06 left out (3-4); baseline loss non-finite at steps 6 " \
                           "(not compared)"
    assert f"  cpu:fp16: mean relative loss gap 3% over 4 steps {RULE}: FAILS" in lines[i + 3]
    runs = {r["label"]: r for r in json.loads((out / "stability.json").read_text())["runs"]}
    assert runs["cpu:bf16"]["loss_gap"]["mean_relative_gap"] == pytest.approx(0.025 / 4)
    assert runs["cpu:fp16"]["loss_gap"]["passes"] is False and runs["cpu:fp32"]["loss_gap"] is None
    report = (out / "report.md").read_text()
    assert "## Mean relative loss gap (Ascend community acceptance)" in report
    assert "| cpu:fp16 | loss | 3% | 4 | 2 | 0 | 0 | FAILS |" in report
    assert f"  - mean relative loss gap 0.625% over 4 steps {RULE}: passes" in report


def test_compare_over_tars_equals_compare_over_directories(two_machines, tmp_path, capsys, monkeypatch):
    gpu, npu = two_machines
    (gpu / "runs" / "cpu_fp32" / "checkpoints").mkdir()
    (gpu / "runs" / "cpu_fp32" / "checkpoints" / "big.bin").write_bytes(b"\0" * 1024)
    gpu_tar, npu_tar = pack_record(gpu, tmp_path / "gpu.tar"), pack_record(npu, tmp_path / "npu.tar.gz")
    with tarfile.open(gpu_tar) as tar:
        names = tar.getnames()
    assert "gpu/manifest.json" in names and not any("checkpoints" in n for n in names)
    with tarfile.open(npu_tar, "r:gz") as tar:
        assert "npu/runs/cpu_bf16/metrics.jsonl" in tar.getnames()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the archives are extracted
    assert main(["bench", "stability", "compare", str(gpu), str(npu), "--out", str(tmp_path / "a")]) == 1  # bf16 parts
    from_dirs = capsys.readouterr().out
    assert main(["bench", "stability", "compare", str(gpu_tar), str(npu_tar), "--out", str(tmp_path / "b")]) == 1
    from_tars = capsys.readouterr().out
    assert from_tars.replace(str(tmp_path / "b"), str(tmp_path / "a")) == from_dirs
    assert _json_without_sources(tmp_path / "a") == _json_without_sources(tmp_path / "b")
    runs = json.loads((tmp_path / "b" / "stability.json").read_text())["runs"]
    assert [r["source"] for r in runs] == [str(gpu_tar), str(npu_tar), str(npu_tar)]
    assert list(scratch.iterdir()) == []  # the extracted copies are gone


def _tar_with(tmp_path: Path, good: Path, bad: tarfile.TarInfo, data: bytes = b"") -> Path:
    path = tmp_path / "evil.tar"
    with tarfile.open(path, "w") as tar:
        tar.add(good, arcname="gpu")
        tar.addfile(bad, io.BytesIO(data) if data else None)
    return path


@pytest.mark.parametrize("kind, message", [
    ("dotdot", "climbs out of the archive with '..'"),
    ("absolute", "has an absolute path"),
    ("symlink", "is a symbolic link to '/etc/passwd'"),
])
def test_an_unsafe_tar_is_refused_with_exit_2(two_machines, tmp_path, capsys, kind, message):
    gpu, _ = two_machines
    if kind == "symlink":
        bad = tarfile.TarInfo("gpu/runs/cpu_fp32/metrics.jsonl.link")
        bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/passwd"
        data = b""
    else:
        target = f"../{tmp_path.name}-escaped.txt" if kind == "dotdot" else str(tmp_path / "absolute.txt")
        bad, data = tarfile.TarInfo(target), b"planted"
        bad.size = len(data)
    evil = _tar_with(tmp_path, gpu, bad, data)
    assert main(["bench", "stability", "compare", str(evil), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("portarl bench stability compare: ") and message in err and "refused" in err
    assert main(["bench", "stability", "--runs", "cpu:bf16", "--replay-from", str(evil), "--out",
                 str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "o" / "runs").exists()
    assert main(["bench", "stability", "dump", "--from", str(evil), "--step", "1", "--out", str(tmp_path / "d")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path.parent / f"{tmp_path.name}-escaped.txt").exists() and not (tmp_path / "absolute.txt").exists()
    with pytest.raises(UnsafeArchive, match="nothing was extracted"), open_record(evil):
        pass


def test_replay_from_a_tar_trains_on_the_extracted_copy(two_machines, tmp_path, monkeypatch, capsys):
    from portarl.bench.stability import harness

    gpu, _ = two_machines
    tar = pack_record(gpu, tmp_path / "gpu.tar")
    seen = {}

    def fake(specs, *, replay_from, origin=None, **kwargs):
        seen.update(dir=Path(replay_from), origin=origin, manifest=(Path(replay_from) / "manifest.json").exists())
        raise FileNotFoundError(f"{origin} holds no recorded rollouts: record with --replay-rollouts")

    monkeypatch.setattr(harness, "_run_stability", fake)
    assert main(["bench", "stability", "--runs", "cpu:bf16", "--replay-from", str(tar), "--out", str(tmp_path / "o")]) == 2
    assert seen["manifest"] and seen["origin"] == str(tar.resolve()) and seen["dir"].name == "gpu"
    assert not seen["dir"].exists()  # removed after the runs
    assert f"{tar.resolve()} holds no recorded rollouts" in capsys.readouterr().err
    assert main(["bench", "stability", "dump", "--from", str(tar), "--step", "1", "--out", str(tmp_path / "d")]) == 2
    assert "holds no recorded rollouts" in capsys.readouterr().err  # read from the extracted copy


def test_pack_cli_and_refusals(two_machines, tmp_path, capsys):
    gpu, _ = two_machines
    assert main(["bench", "stability", "pack", str(gpu)]) == 0
    assert f"packed: {gpu}.tar" in capsys.readouterr().out and tarfile.is_tarfile(f"{gpu}.tar")
    assert main(["bench", "stability", "pack", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.tar")]) == 2
    assert "is not a stability run directory" in capsys.readouterr().err
    (gpu / "link").symlink_to("/etc/passwd")
    with pytest.raises(ValueError, match="is a symbolic link"):
        pack_record(gpu, tmp_path / "y.tar")
