"""A frozen rank stops the job, naming the rank, within ``distributed.timeout_s`` (2-process
Gloo; issue 12, item 5); a rank whose user code ends its process stops every rank at once,
and its line names the rank (issue 44)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from portarl.runtime.distributed import local_launcher

pytest.importorskip("transformers")

from pathlib import Path  # noqa: E402

from test_fsdp_gloo import FAST, _env, _train, _worker_pids  # noqa: E402

TRAINER_TESTS = Path(__file__).parents[1] / "trainer"

TIMEOUT_S = 16  # the heartbeat fires at 8 s, the Gloo collective timeout at 16 s


def test_frozen_rank_stops_the_job_naming_it(tmp_path):
    cmd = [*local_launcher(2), "-m", "portarl", "train",
           "--device", "cpu", "--output-dir", str(tmp_path)]
    for item in (*FAST, "train.steps=400", "checkpoint.every=1000", f"distributed.timeout_s={TIMEOUT_S}"):
        cmd += ["--set", item]
    launched = time.monotonic()
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    frozen = None
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        # The scheduling margin is this run's own start-up time (launch to first step): on a
        # loaded machine both stretch alike, so load slows the test but cannot fail it.
        margin = max(10.0, time.monotonic() - launched)
        workers = _worker_pids(proc.pid)
        frozen = workers[1]
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # rank 0 must give up by itself within the timeout (plus the margin) ...
        while time.monotonic() - stopped_at < TIMEOUT_S + margin:
            try:
                os.kill(workers[0], 0)
                if open(f"/proc/{workers[0]}/stat").read().split()[2] == "Z":
                    break
            except (ProcessLookupError, FileNotFoundError):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"rank 0 still waiting {TIMEOUT_S + margin:.0f} s after rank 1 froze")
        # ... and torchrun then ends the job (it SIGKILLs the stopped rank after its grace period).
        output, _ = proc.communicate(timeout=120)
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "rank 1 has sent no heartbeat" in output and f"distributed.timeout_s={TIMEOUT_S}" in output, output[-4000:]


def test_a_rank_whose_reward_calls_os_exit_0_stops_every_rank_and_is_named(tmp_path):
    """Rank 1's reward calls ``os._exit(0)``: its supervisor exits non-zero with the line
    naming rank 1, the step and the reward; torchrun then ends the job, and rank 0, in a
    collective with the dead rank, stops at once (Gloo sees the connection drop) instead of
    waiting for the heartbeat. Before, rank 1 exited 0 without a word."""
    path = [str(TRAINER_TESTS), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = _env(DIE="exit0", DIE_RANK="1", PYTHONPATH=os.pathsep.join(path))
    proc = _train(tmp_path, 2, "train.steps=2", "rewards=[{name: 'dying_code:reward'}]",
                  f"distributed.timeout_s={10 * TIMEOUT_S}", env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert "portarl train: rank 1: the run died in step 1 (scoring), while reward 'dying_code:reward' on sample 0 " \
        "(prompt " in output and "exited with code 0 without finishing" in output, output[-4000:]
    assert "rank      : 1 (local_rank: 1)\n  exitcode  : 5" in output, output[-4000:]  # torchrun's root cause
    # Rank 0 stopped by itself, before the liveness watch (at half of distributed.timeout_s) had to,
    # with one line (or torchrun's SIGTERM first), not the failed collective's traceback.
    assert "has sent no heartbeat" not in output, output[-4000:]
    assert "gloo/transport/tcp/pair.cc" not in output, output[-4000:]  # the collective's own RuntimeError
