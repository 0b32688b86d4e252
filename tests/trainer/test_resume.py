"""Checkpoints and resume: SIGKILL mid-run then --resume completes with metrics that
continue, no corrupt checkpoint, and (on CPU) the same metrics as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portarl.trainer.checkpoint import CheckpointManager

import run_guard  # noqa: E402
from trainer_fast import FAST  # noqa: E402

COMPARED = ("reward/mean", "loss", "grad_norm", "kl", "completion/len_mean")


def _cmd(out: Path, *extra: str) -> list[str]:
    sets = [x for item in FAST if not item.startswith("train.steps") for x in ("--set", item)]
    return [sys.executable, "-m", "portarl", "train", "--device", "cpu", "--output-dir", str(out), *sets,
            "--set", "train.steps=30", "--set", "checkpoint.every=3", "--set", "checkpoint.keep_last=2",
            "--set", "loss.kl_coef=0.01", *extra]


def _steps(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.compares_runs
def test_sigkill_then_resume(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    reference = tmp_path / "uninterrupted"
    subprocess.run(_cmd(reference), check=True, env=env, capture_output=True, timeout=600)
    # The default rewards train here: over 30 steps the format reward and the KL term give
    # gradients (the compared numbers would agree trivially if the weights never moved).
    run_guard.assert_run_trained(reference, what="the uninterrupted 30-step run")

    out = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(_steps(out)) < 11 and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(_steps(out))
    assert 11 <= killed_at < 30

    manager = CheckpointManager(out)
    for ckpt in manager.complete():  # every complete checkpoint is loadable
        assert CheckpointManager.load_state(ckpt)["step"] == int(ckpt.name.split("-")[1])

    done = subprocess.run(_cmd(out, "--resume"), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _steps(out)
    assert [r["step"] for r in rows] == list(range(1, 31)), "metrics must continue without gaps or duplicates"
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert len(manager.complete()) == 2  # keep_last
    run_guard.assert_run_trained(out, what="the killed and resumed run")
    expected = _steps(reference)
    for got, want in zip(rows, expected):
        for key in COMPARED:
            assert got[key] == want[key], f"step {got['step']} {key}: resumed {got[key]} vs uninterrupted {want[key]}"


def test_interrupted_checkpoint_write_is_ignored_and_cleaned(make_trainer):
    trainer = make_trainer("train.steps=2", "checkpoint.every=1")
    trainer.train()
    root = trainer.output_dir / "checkpoints"
    partial = root / ".tmp-step-000003-999"
    partial.mkdir()
    (partial / "trainer_state.pt").write_bytes(b"torn")
    no_marker = root / "step-000004"
    no_marker.mkdir()
    assert CheckpointManager(trainer.output_dir).latest().name == "step-000002"
    fresh = make_trainer("train.steps=3", "checkpoint.every=1")
    assert fresh.resume() == 2
    assert not partial.exists() and not no_marker.exists()
