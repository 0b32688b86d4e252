"""hardware-check's last stage: the gpu / npu-marked tests in two pytest runs side by side,
the hardware-sized ones one at a time in a process of their own (several at once ran the
H200 loan's host out of memory), the rest in xdist workers. On the CPU the marked tests
skip, so these tests hold the split and the deadline, not a device run."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from portarl.bench.hardware import tests_stage

REPO = Path(__file__).resolve().parents[2]


def _collected(select: str, path: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", select, path], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_every_marked_test_runs_once_and_the_hardware_sized_ones_alone(monkeypatch, tmp_path):
    monkeypatch.setattr(tests_stage, "_has_xdist", lambda: True)
    runs = tests_stage.hardware_tests_runs(torch.device("cuda"), tmp_path)
    assert [r.name for r in runs] == ["parallel", "hardware-sized"]
    assert "-n" in runs[0].argv and "-n" not in runs[1].argv, "the hardware-sized run is one process"
    assert len({r.junit for r in runs} | {r.log for r in runs}) == 4, "each run its own files"
    path = "tests/parity/test_logprobs.py"
    everything = _collected("gpu", path)
    parallel, sized = (_collected(r.select, path) for r in runs)
    assert sorted(parallel + sized) == sorted(everything) and not set(parallel) & set(sized)
    assert len(sized) == 15 and all("test_logprobs_large_shapes_on_hardware[cuda-gpu-" in t for t in sized)
    cases = [t.split("[")[1].rsplit("-", 1)[0] for t in sized]  # dtype fastest: a case's draws are made once
    assert cases == [c for c in dict.fromkeys(cases) for _ in range(3)]


def test_on_the_cpu_or_without_xdist_one_run_of_every_marked_test(monkeypatch, tmp_path):
    (run,) = tests_stage.hardware_tests_runs(torch.device("cpu"), tmp_path)
    assert run.select == "gpu or npu" and "-n" not in run.argv
    monkeypatch.setattr(tests_stage, "_has_xdist", lambda: False)
    (run,) = tests_stage.hardware_tests_runs(torch.device("cuda"), tmp_path)
    assert run.select == "gpu" and "-n" not in run.argv


def test_a_run_past_the_deadline_is_killed_with_its_children_and_the_others_kept(tmp_path):
    """The hung run (a parent whose child also sleeps) is stopped at the deadline with its
    process group; the run that finished keeps its exit code."""
    mark = f"hung-run-{uuid.uuid4().hex}"  # names this test's processes alone for pgrep
    hang = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', "
            f"'{mark}']); time.sleep(600)")
    runs = [tests_stage.PytestRun("quick", "", [sys.executable, "-c", "print('done')"], tmp_path / "q.xml", tmp_path / "q.log"),
            tests_stage.PytestRun("hung", "", [sys.executable, "-c", hang, mark], tmp_path / "h.xml", tmp_path / "h.log")]
    lines: list[str] = []
    started = time.monotonic()
    codes = tests_stage._run_all(runs, {"PATH": "/usr/bin:/bin"}, deadline=10.0, log=lines.append)
    assert codes == [0, None]
    assert time.monotonic() - started < 300, "the hung run was not stopped at its deadline"
    assert (tmp_path / "q.log").read_text().strip() == "done"
    assert len(lines) == 2 and all(line.startswith("$ ") for line in lines)
    leftover = subprocess.run(["pgrep", "-f", mark], capture_output=True, text=True).stdout.split()
    assert not leftover, f"processes of the hung run left running: {leftover}"


def test_the_stage_on_the_cpu_says_none_ran(monkeypatch, tmp_path):
    """The whole stage, as hardware-check runs it on the CPU (restricted to one file): the
    marked tests skip with their reason, and the stage is n/a, not passed."""
    real_runs = tests_stage.hardware_tests_runs

    def one_file(device, work):
        runs = real_runs(device, work)
        for r in runs:
            r.argv[-1] = str(REPO / "tests" / "test_ops_errors.py")
        return runs

    monkeypatch.setattr(tests_stage, "hardware_tests_runs", one_file)
    lines: list[str] = []
    result = tests_stage.hardware_tests(None, torch.device("cpu"), tmp_path, tmp_path, lines.append)
    assert result["status"] == "n/a", result
    assert result["counts"]["skipped"] > 0 and result["counts"]["passed"] == 0
    assert any("needs an NVIDIA GPU" in reason for reason in result["skipped"]), result["skipped"]
