"""Data-parallel FSDP2 training for real: 2 processes on the Gloo backend (torchrun) against
1 process on the same global batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import run_guard  # noqa: E402
from portarl.trainer.checkpoint import CheckpointManager  # noqa: E402
from portarl.runtime.distributed import local_launcher

HERE = Path(__file__).parent
LR = 1e-2
FAST = [
    "train.prompts_per_step=4", "train.sft_warmup_steps=0", "train.micro_batch_size=4", "rollout.group_size=4",
    "rollout.max_new_tokens=3", "data.synthetic_size=64", "model.hidden_size=32", "model.intermediate_size=64",
    "logging.progress=false", "logging.tensorboard=false", "logging.plot=false", f"optim.lr={LR}",
    "loss.kl_coef=0.05", "checkpoint.every=1", "rewards=[{name: 'dist_rewards:length_and_digits'}]",
]
#: fp32 results of one process vs two: same math, different reduction order (all-reduce,
#: sharded optimizer step); a few fp32 ulps of the values involved.
RTOL, ATOL = 1e-5, 1e-6
#: Parameters after one AdamW step: the update is lr * g / (|g| + eps), so for an element
#: whose gradient is near 0 the reduction-order noise of g is amplified up to a fraction of
#: lr. Allow 1e-3 of the step; the median element must still agree to fp32 rounding.
PARAM_ATOL = 1e-3 * LR


def _env(**extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **extra}
    env.pop("TRITON_INTERPRET", None)
    return env


def _train(out: Path, ranks: int, *sets: str, resume: bool = False, env=None) -> subprocess.CompletedProcess:
    launcher = [*local_launcher(ranks), "-m", "portarl"] \
        if ranks > 1 else [sys.executable, "-m", "portarl"]
    cmd = [*launcher, "train", "--device", "cpu", "--output-dir", str(out)]
    for item in (*FAST, *sets):
        cmd += ["--set", item]
    if resume:
        cmd.append("--resume")
    return subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=600)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _params_from(directory: Path) -> dict[str, torch.Tensor]:
    """Model parameters of a checkpoint, sharded (DCP) or not, loaded in this process."""
    from portarl.assets.models import build_tiny

    model, _ = build_tiny(hidden_size=32, intermediate_size=64)
    if CheckpointManager.is_sharded(directory):
        optimizer = torch.optim.AdamW(model.parameters())
        CheckpointManager.load_sharded(directory, model, optimizer)
    else:
        CheckpointManager.load_weights(model, directory)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    single, double = root / "single", root / "double"
    # One decode path for both: two ranks decode through the Hugging Face forward (FSDP2's
    # sharded parameters rule out the lean step), whose CPU attention kernel rounds other
    # than the lean step's written-out fp32 attention; the behaviour log-probs would then
    # differ in their last bits, and AdamW amplifies that for near-zero gradients. Likewise
    # unshared rows: shared-prompt rows (train.share_prompt) are composed from each rank's
    # own groups, so one process and two ranks multiply matrices of other shapes (measured:
    # down_proj past PARAM_ATOL after AdamW's first step); this test is about the sharding.
    for out, ranks in ((single, 1), (double, 2)):
        proc = _train(out, ranks, "train.steps=1", "rollout.lean_decode=false", "train.share_prompt=false")
        assert proc.returncode == 0, proc.stderr[-4000:]
    return single, double


def assert_trained(*runs: Path) -> None:
    """Each run compared trained (tests/run_guard.py): a step's grad_norm > 0 and its newest
    checkpoint's weights moved from the start; runs that did not train agree whatever the
    layout, so their comparison could not fail."""
    for run in runs:
        run_guard.assert_run_trained(run, what=f"the {run.name} run")


def assert_same_step(single: Path, double: Path, keys=("loss", "pg/loss", "kl/loss", "grad_norm")) -> None:
    """The first step's rollouts and metrics of a 1-process and a 2-rank run agree, and both
    runs trained (the guard)."""
    assert_trained(single, double)
    a, b = _rows(single)[0], _rows(double)[0]
    assert a["reward/mean"] == b["reward/mean"], "both runs must roll out the same completions"
    for key in keys:
        assert b[key] == pytest.approx(a[key], rel=RTOL, abs=ATOL), key


def assert_params_close(pa: dict, pb: dict) -> None:
    """Parameters after the step equal within PARAM_ATOL (median ATOL). That they moved from
    the start is the guard's (:func:`assert_trained`, called by the tests that compare)."""
    assert pa.keys() == pb.keys() and pa
    diffs = []
    for key in pa:
        torch.testing.assert_close(pb[key], pa[key], rtol=0, atol=PARAM_ATOL, msg=key)
        diffs.append((pb[key] - pa[key]).abs().flatten())
    assert torch.cat(diffs).median() <= ATOL


@pytest.mark.compares_runs
def test_one_step_on_two_ranks_matches_one_process(one_and_two):
    single, double = one_and_two
    assert_same_step(single, double)
    assert_params_close(_params_from(CheckpointManager(single).latest()),
                        _params_from(CheckpointManager(double).latest()))


def _params_from_init():
    from portarl.assets.models import build_tiny

    model, _ = build_tiny(hidden_size=32, intermediate_size=64)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_nan_on_one_rank_makes_both_skip(tmp_path):
    proc = _train(tmp_path, 2, "train.steps=2", env=_env(PORTARL_FAULT_INJECT="old_logp@1@1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(tmp_path)
    assert rows[0]["skipped"] == 1 and rows[0]["guard/nonfinite_tensor"] == "old_logp"
    assert rows[1]["skipped"] == 0
    first = CheckpointManager(tmp_path).complete()[0]
    assert CheckpointManager.load_state(first)["step"] == 1
    # Both ranks skipped: every shard of the parameters is still the initial model's.
    after_skip, start = _params_from(first), _params_from_init()
    assert all(torch.equal(after_skip[k], start[k]) for k in start)


def _worker_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the process doing each rank's work: the supervised child (portarl/runtime/supervisor.py)
    of torchrun's worker process (its children with RANK in their environment)."""
    from proc_tree import supervised

    found = {}
    for child in Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        ranks = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
        if ranks:
            found[int(ranks[0])] = supervised(int(child))
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_on_one_rank_stops_both_with_one_checkpoint(tmp_path, sig):
    """A signal that reaches one rank first (Ctrl-C races, a scheduler signalling one process):
    the stop is agreed by every rank at the end of the step, then all save one checkpoint."""
    cmd = [*local_launcher(2), "-m", "portarl", "train",
           "--device", "cpu", "--output-dir", str(tmp_path)]
    for item in (*FAST, "train.steps=400", "checkpoint.every=1000"):
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a hang is cleaned up whole
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        os.kill(_worker_pids(proc.pid)[1], sig)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
    assert f"stopped by {sig.name} after step" in output and "checkpoint saved" in output, output[-4000:]
    last = _rows(tmp_path)[-1]["step"]
    assert last < 400, "the run must stop early"
    latest = CheckpointManager(tmp_path).latest()
    assert CheckpointManager.is_sharded(latest) and CheckpointManager.load_state(latest)["step"] == last


def test_save_on_two_ranks_resume_on_one(tmp_path):
    proc = _train(tmp_path, 2, "train.steps=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert CheckpointManager.is_sharded(CheckpointManager(tmp_path).latest())
    proc = _train(tmp_path, 1, "train.steps=3", resume=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]
    assert CheckpointManager.load_state(CheckpointManager(tmp_path).latest())["step"] == 3


def test_reward_error_on_one_rank_stops_both_with_a_checkpoint(tmp_path):
    """A reward that raises on rank 1 only: every rank stops at that step (the stop's
    checkpoint is collective, a rank going on alone would hang its peer), rank 0 logs the
    failing rank's message, and the checkpoint of the last good step is complete."""
    proc = _train(tmp_path, 2, "train.steps=3", "checkpoint.every=1000", "distributed.timeout_s=120",
                  "rewards=[{name: 'dist_rewards:fails_on_rank_1_at_step_2'}]")
    assert proc.returncode != 0, proc.stderr[-4000:]
    assert "grader is down" in proc.stderr and "(on rank 1)" in proc.stderr, proc.stderr[-4000:]
    assert [row["step"] for row in _rows(tmp_path)] == [1]
    latest = CheckpointManager(tmp_path).latest()
    assert CheckpointManager.is_sharded(latest) and CheckpointManager.load_state(latest)["step"] == 1
    stopped = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert any(e.get("kind") == "stopped" and "(on rank 1)" in e.get("message", "") for e in stopped), stopped
