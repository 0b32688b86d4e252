"""rollout.mode=async (max_staleness 1): a run killed (or stopped) anywhere and resumed
ends with the weights and metrics of the uninterrupted run, bitwise on the CPU (issue 33
item 8). Before, the first step after a resume trained on a batch sampled by the
checkpoint's own weights (staleness 0) where the uninterrupted run's came from the
version before (staleness 1), and the runs parted from there.

Kill points are made deterministic with the worker's ``hang@S`` fault (the worker never
answers the generate request of step S, so the trainer cannot get past it); waits poll
the run's files with limits that only bound a test that has already failed."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from portarl.rollout.async_worker import FAULT_ENV
from portarl.trainer.checkpoint import CheckpointManager

import run_guard
from test_async_rollout import VARIED, _jsonl, _start, _wait_rows

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the worker dies with the trainer on Linux")

#: VARIED: a reward that differs within every group, so that the runs compared train.
SETS = ("train.steps=6", "checkpoint.every=2", "checkpoint.keep_last=5", VARIED)


def _finish(proc) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]


def _wait_for(proc, ready, what: str) -> None:
    limit = time.monotonic() + 600  # bounds a test that has already failed; progress is polled
    while not ready():
        assert proc.poll() is None and time.monotonic() < limit, f"the run never got to {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("async-whole")
    _finish(_start(out, *SETS))
    return out


def _kill_between_checkpoints(proc, out: Path) -> int:
    _wait_rows(proc, out, 3)  # step 4's batch never comes: killed after step 3, checkpoint 2 is the newest
    proc.kill()
    return 2


def _kill_while_a_checkpoint_waits_for_its_batch_in_flight(proc, out: Path) -> int:
    _wait_rows(proc, out, 4)  # checkpoint 4 waits for step 5's batch, which never comes
    proc.kill()
    return 2


def _kill_right_after_a_checkpoint(proc, out: Path) -> int:
    manager = CheckpointManager(out)
    _wait_for(proc, lambda: manager.latest() is not None and manager.latest().name == "step-000004", "checkpoint 4")
    proc.kill()  # step 6's batch never comes: checkpoint 6 cannot exist
    return 4


def _sigterm(proc, out: Path) -> int:
    _wait_rows(proc, out, 2)
    # To the command's process group, as a shell or a scheduler does: the run's process gets it
    # at once (one sent to the supervising parent alone is forwarded up to a second later,
    # portarl/runtime/supervisor.py, by which time this tiny run could have finished)
    os.killpg(proc.pid, signal.SIGTERM)  # finishes its step, saves (with the batch in flight), exits 143
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err[-3000:]
    return CheckpointManager.load_state(CheckpointManager(out).latest())["step"]


@pytest.mark.compares_runs
@pytest.mark.parametrize("fault, stop", [("hang@4", _kill_between_checkpoints),
                                         ("hang@5", _kill_while_a_checkpoint_waits_for_its_batch_in_flight),
                                         ("hang@6", _kill_right_after_a_checkpoint),
                                         (None, _sigterm)], ids=lambda v: getattr(v, "__name__", v))
def test_async_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path, uninterrupted, fault, stop):
    out = tmp_path / "stopped"
    proc = _start(out, *SETS, **({FAULT_ENV: fault} if fault else {}))
    try:
        resumed_from = stop(proc, out)
        proc.wait()
    finally:
        proc.kill()
        proc.communicate()
    assert 2 <= resumed_from < 6
    _finish(_start(out, *SETS, resume=True))
    run_guard.assert_run_trained(uninterrupted, what="the uninterrupted run")
    run_guard.assert_run_trained(out, what=f"the run resumed from step {resumed_from}")

    want, got = _jsonl(uninterrupted / "metrics.jsonl"), _jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["rollout/staleness_max"] for r in got] == [0, 1, 1, 1, 1, 1]
    for a, b in zip(want, got):  # every number but the timings (``*_s``)
        differ = {k: (v, b.get(k)) for k, v in a.items() if not k.endswith("_s") and b.get(k) != v}
        assert not differ, f"step {a['step']} (resumed from step {resumed_from}): uninterrupted vs resumed {differ}"
    assert _jsonl(out / "rollout_batches.jsonl") == _jsonl(uninterrupted / "rollout_batches.jsonl")
    final = "checkpoints/step-000006/model.safetensors"
    a, b = load_file(uninterrupted / final), load_file(out / final)
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == [], "final weights differ"


def test_a_checkpoint_of_a_failed_pipeline_holds_no_batches_in_flight_and_its_resume_says_so(tmp_path):
    """The worker dies: the run stops with a checkpoint that waits for nothing (no batch is
    coming) and stores none; a resume from it generates the next batch with the checkpoint's
    weights (staleness 0 for that step only), says so in its log, and runs to the end."""
    out = tmp_path / "failed"
    proc = _start(out, *SETS, **{FAULT_ENV: "die@4"})
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 3, err[-3000:]
    checkpoint = CheckpointManager(out).latest()
    stopped_at = CheckpointManager.load_state(checkpoint)["step"]
    assert 1 <= stopped_at < 4 and CheckpointManager.load_state(checkpoint)["async_in_flight"] is None

    proc = _start(out, *SETS, resume=True)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert f"resumed async rollout from step {stopped_at} without batches in flight" in err
    rows = _jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    want = [0] + [1] * 5
    want[stopped_at] = 0  # the first resumed step: sampled by the checkpoint's own weights
    assert [r["rollout/staleness_max"] for r in rows] == want


@pytest.mark.parametrize("sync", ["collective", "file"])
def test_a_worker_that_dies_during_a_periodic_checkpoint_leaves_that_checkpoint_whole(tmp_path, monkeypatch, sync):
    """The worker dies while the checkpoint of step 2 is written (it has sent the batch of
    step 3, which that checkpoint holds): step 3 finds it dead and the run stops, keeping
    checkpoint 2 as it was, its batch in flight included. Before, the stop saved step 2 again
    without it, over the complete one (a checkpoint of a step is never replaced by a poorer
    one of the same step: portarl.trainer.checkpoint.manager)."""
    from portarl.trainer import GRPOTrainer, TrainingStopped, build_from_config
    from trainer_fast import fast_config

    cfg = fast_config(tmp_path, "train.steps=4", "checkpoint.every=2", "rollout.mode=async",
                      f"rollout.weight_sync={sync}")
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    save = trainer.checkpoints.save

    def save_while_the_worker_dies(step, *args):
        path = save(step, *args)
        if step == 2:
            worker = trainer.async_rollout.client.proc
            worker.kill()
            worker.wait()
        return path

    monkeypatch.setattr(trainer.checkpoints, "save", save_while_the_worker_dies)
    with pytest.raises(TrainingStopped) as info:
        trainer.train(overwrite=True)
    assert info.value.tensor_name == "rollout_worker" and "stopping at step 3" in str(info.value), str(info.value)
    assert info.value.checkpoint.name == "step-000002"
    state = CheckpointManager.load_state(info.value.checkpoint)
    assert [batch["step"] for batch in state["async_in_flight"] or []] == [3]


MOE_SETS = ("model.path=tiny-qwen3-moe", "rollout.routing_replay=rollout", "train.steps=4", "checkpoint.every=2",
            "checkpoint.keep_last=5", VARIED)


@pytest.mark.compares_runs
def test_an_moe_run_resumed_with_a_batch_in_flight_replays_its_routed_experts(tmp_path):
    """Mixture of experts with routing replay (issue 48): the checkpoint of step 2 holds step
    3's batch in flight with the experts the worker recorded, and the resumed run replays
    them: every metric (``rollout/routing_agreement`` included: it exists only for a batch
    that carries experts) and the final weights equal the uninterrupted run's bitwise."""
    from portarl.moe.routing import experts_from_json

    whole, out = tmp_path / "whole", tmp_path / "stopped"
    _finish(_start(whole, *MOE_SETS))
    proc = _start(out, *MOE_SETS, **{FAULT_ENV: "hang@4"})
    try:
        _kill_between_checkpoints(proc, out)
        proc.wait()
    finally:
        proc.kill()
        proc.communicate()
    checkpoint = CheckpointManager(out).latest()
    assert checkpoint.name == "step-000002"
    (entry,) = CheckpointManager.load_state(checkpoint)["async_in_flight"]
    experts = experts_from_json(entry["reply"]["routed_experts"])
    assert entry["step"] == 3 and len(experts) == len(entry["reply"]["completion_ids"])
    _finish(_start(out, *MOE_SETS, resume=True))
    run_guard.assert_run_trained(whole, what="the uninterrupted MoE run")
    run_guard.assert_run_trained(out, what="the resumed MoE run")

    want, got = _jsonl(whole / "metrics.jsonl"), _jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert all("rollout/routing_agreement" in r for r in got)
    for a, b in zip(want, got):
        differ = {k: (v, b.get(k)) for k, v in a.items() if not k.endswith("_s") and b.get(k) != v}
        assert not differ, f"step {a['step']}: uninterrupted vs resumed {differ}"
    final = "checkpoints/step-000004/model.safetensors"
    a, b = load_file(whole / final), load_file(out / final)
    assert [name for name in a if not torch.equal(a[name], b[name])] == [], "final weights differ"
