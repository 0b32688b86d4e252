"""Record on one "machine", replay on another, compare: two separate processes with only
the run directory passed between them (``cpu:fp32`` records, ``cpu:bf16:npu-emulated``
replays), then refusals and a native crash reported as a run's verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import run_guard

pytest.importorskip("transformers")

from portarl.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "data.synthetic_size=64",
        "model.hidden_size=32", "model.intermediate_size=64", "train.sft_warmup_steps=0", "train.micro_batch_size=16"]


def _sets(items=TINY):
    return [a for item in items for a in ("--set", item)]


def _cli(*args, env=None):
    """``portarl`` in its own process: a stand-in for another machine."""
    return subprocess.run([sys.executable, "-m", "portarl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    gpu = tmp_path_factory.mktemp("machines") / "gpu"
    proc = _cli("bench", "stability", "--runs", "cpu:fp32", "--steps", "3", "--replay-rollouts", "--out", str(gpu), *_sets())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return gpu


@pytest.mark.compares_runs
def test_record_replay_elsewhere_and_compare(recorded, tmp_path, capsys):
    gpu = recorded
    manifest = json.loads((gpu / "manifest.json").read_text())
    assert manifest["recording"]["label"] == "cpu:fp32" and manifest["steps"] == 3
    for needed in ("config.yaml", "rollouts.safetensors", "start-model/config.json", "runs/cpu_fp32/tokens.safetensors",
                   "runs/cpu_fp32/metrics.jsonl", "runs/cpu_fp32/run.json"):
        assert (gpu / needed).exists(), needed
    assert not list(gpu.rglob("*.job.json"))

    # "the other machine": a copy of the directory only, somewhere else
    moved = tmp_path / "arrived"
    subprocess.run(["cp", "-r", str(gpu), str(moved)], check=True)
    npu = tmp_path / "npu"
    proc = _cli("bench", "stability", "--runs", "cpu:bf16:npu-emulated", "--replay-from", str(moved), "--out", str(npu))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((npu / "runs" / "cpu_bf16_npu-emulated" / "run.json").read_text())
    recorded_sha = json.loads((gpu / "runs" / "cpu_fp32" / "run.json").read_text())["rollouts"]["sha256"]
    assert run["rollouts"] == {"mode": "replayed", "sha256": recorded_sha} and run["steps"] == 3
    # the two runs compared trained (their policies moved from the shared start model)
    run_guard.assert_run_trained(gpu / "runs" / "cpu_fp32", what="the recording (cpu:fp32)")
    run_guard.assert_run_trained(npu / "runs" / "cpu_bf16_npu-emulated", what="the replay (cpu:bf16:npu-emulated)")

    report_dir = tmp_path / "report"
    assert main(["bench", "stability", "compare", str(gpu), str(npu), "--out", str(report_dir), "--threshold", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "cpu:fp32: baseline" in out and "cpu:bf16:npu-emulated [EMULATION]: tracks" in out
    analysis = json.loads((report_dir / "stability.json").read_text())
    rows = analysis["tokens"]["cpu:bf16:npu-emulated"]
    assert [t["step"] for t in rows] == [1, 2, 3]
    assert all(t["max_abs_dlogp"] > 0 and t["max_abs_dlogp"] >= t["mean_abs_dlogp"] for t in rows)  # bf16 != fp32
    report = (report_dir / "report.md").read_text()
    assert "## Token-level divergence" in report and "![token-level divergence](tokens.png)" in report
    assert "## Environment per run" in report and torch.__version__ in report and "[EMULATION]" in report
    assert (report_dir / "tokens.png").exists() and (report_dir / "stability.png").exists()
    assert "mean relative loss gap" in out and "(Ascend community acceptance: < 2%" in out
    # The recording as one .tar (what a machine that returns few files hands back): the same report.
    from portarl.bench.stability.archive import pack_record

    packed = pack_record(gpu, tmp_path / "gpu.tar")
    assert main(["bench", "stability", "compare", str(packed), str(npu), "--out", str(tmp_path / "from-tar"),
                 "--threshold", "1e9"]) == 0
    assert capsys.readouterr().out.replace(str(tmp_path / "from-tar"), str(report_dir)) == out
    from_tar = json.loads((tmp_path / "from-tar" / "stability.json").read_text())
    assert from_tar["tokens"] == analysis["tokens"] and from_tar["runs"][1]["loss_gap"] == analysis["runs"][1]["loss_gap"]
    # Any gap at all parts at threshold 0: the exit status gates CI.
    assert main(["bench", "stability", "compare", str(gpu), str(npu), "--out", str(report_dir), "--threshold", "0"]) == 1
    assert "parted from cpu:fp32: cpu:bf16:npu-emulated" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--seed", "7"], "seeds mismatch: train.seed: recorded 0, here 7"),
    (["--set", "rollout.group_size=2"], "prompts mismatch: rollout.group_size"),
    (["--set", "data.synthetic_size=32"], "data order mismatch: data.synthetic_size"),
    (["--set", "optim.lr=0.5"], "config mismatch: optim.lr"),
    (["--steps", "4"], "steps mismatch: 4 steps asked, 3 recorded"),
])
def test_mismatched_replay_is_refused(recorded, tmp_path, capsys, args, message):
    out = tmp_path / "npu"
    assert main(["bench", "stability", "--runs", "cpu:bf16", "--replay-from", str(recorded), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert "refusing to replay the rollouts recorded in" in err and message in err
    assert not (out / "runs").exists()  # refused before anything trained


def test_pickled_rollouts_in_a_run_directory_are_refused(recorded, tmp_path, capsys):
    import pickle

    class Planted:
        def __reduce__(self):
            return (open, (str(marker), "w"))  # unpickling would create the marker

    arrived = tmp_path / "arrived"
    subprocess.run(["cp", "-r", str(recorded), str(arrived)], check=True)
    marker = tmp_path / "code-ran"
    (arrived / "rollouts.safetensors").write_bytes(pickle.dumps([Planted()]))
    assert main(["bench", "stability", "--runs", "cpu:bf16", "--replay-from", str(arrived), "--out", str(tmp_path / "o")]) == 2
    assert "never unpickles recorded rollouts" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "o" / "runs").exists()


def test_a_native_crash_is_that_runs_verdict(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PORTARL_STABILITY_FAULT", "cpu:bf16=SIGFPE@2")  # the bf16 run's process raises SIGFPE
    assert main(["bench", "stability", "--runs", "cpu:fp32,cpu:bf16", "--steps", "2", "--out", str(tmp_path), *_sets()]) == 0
    out = capsys.readouterr().out
    assert "cpu:bf16: PARTS from cpu:fp32 at step 2 (missing" in out
    assert "CRASHED: process killed by SIGFPE" in out
    assert "cpu:fp32: baseline" in out and (tmp_path / "report.md").exists()
