"""One run per output directory (issue 33 item 3): a second ``portarl train`` on a
directory whose run is alive (fresh start, ``--resume`` or ``--overwrite``) is refused with
one line naming the holder's pid and exit 2, deleting nothing; a SIGKILLed holder leaves no
stale lock. The real CLI in subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portarl.trainer.checkpoint import CheckpointManager
from trainer_fast import FAST

HERE = Path(__file__).parent


def _command(out: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "portarl", "train", "--device", "cpu", "--output-dir", str(out)]
    for item in (*FAST, "rewards=[{name: 'slow_rewards:held_zero'}]", *extra):
        cmd += ["--set", item] if "=" in item and not item.startswith("--") else [item]
    return cmd


def _env(gate: Path) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HOLD_DIR": str(gate),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    return env


def _start_holder(out: Path, gate: Path) -> subprocess.Popen:
    """A run that checkpoints step 1, then holds step 2 open (slow_rewards.held_zero)."""
    proc = subprocess.Popen(_command(out, "train.steps=400", "checkpoint.every=1"), env=_env(gate),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600  # slowed by load, never failed by it
    while CheckpointManager(out).latest() is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    (gate / "hold").touch()
    while not (gate / "holding").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    return proc


@pytest.fixture
def live_run(tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    out = tmp_path / "run"
    proc = _start_holder(out, gate)
    yield out, gate, proc
    (gate / "release").touch()
    proc.kill()
    proc.wait()
    proc.stderr.close()


def test_a_second_run_on_a_live_directory_is_refused_and_deletes_nothing(live_run):
    out, gate, holder = live_run
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    free = gate.parent / "free-gate"  # the second run's reward never holds: it would run to the end if let in
    free.mkdir()
    for mode in ([], ["--resume"], ["--overwrite"]):
        second = subprocess.run(_command(out, "train.steps=3", *mode), env=_env(free), capture_output=True, text=True,
                                timeout=600)
        assert second.returncode == 2, (mode, second.stderr[-3000:])
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert lines == [f"portarl train: output directory {out} is in use by another run (pid {holder.pid}): wait "
                         "for it to end (or stop it), or choose another --output-dir"], (mode, second.stderr)
        assert holder.poll() is None
        assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before, mode


def test_a_sigkilled_run_leaves_no_stale_lock(live_run):
    out, gate, holder = live_run
    free = gate.parent / "free-gate"
    free.mkdir()
    refused = subprocess.run(_command(out, "train.steps=3", "--resume"), env=_env(free), capture_output=True, text=True,
                             timeout=600)
    assert refused.returncode == 2 and f"in use by another run (pid {holder.pid})" in refused.stderr, refused.stderr
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    resumed = subprocess.run(_command(out, "train.steps=3", "--resume"), env=_env(free), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert CheckpointManager(out).latest().name == "step-000003"
