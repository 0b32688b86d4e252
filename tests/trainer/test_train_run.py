"""End-to-end runs on the tiny model: parameters change, logs and checkpoints exist."""

from __future__ import annotations

import json

import pytest
import torch

import run_guard
from portarl.trainer.checkpoint import CheckpointManager
from trainer_fast import varied_reward


def test_three_steps_change_every_trainable_parameter(make_trainer):
    """A reward with spread within groups: with the built-in ones the first step's gradient is
    0 and "every parameter changed" rested on a later step's chance hit of the format reward."""
    trainer = make_trainer("loss.kl_coef=0.01", "optim.weight_decay=0.0", rewards=[varied_reward])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert result.steps == 3
    unchanged = [n for n, p in trainer.model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    assert not unchanged, f"parameters not updated by 3 GRPO steps: {unchanged}"
    rows = [json.loads(line) for line in (trainer.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        for key in ("reward/mean", "kl", "grad_norm", "skipped"):
            assert key in row
        assert row["skipped"] == 0
    assert CheckpointManager(trainer.output_dir).latest().name == "step-000003"
    assert (trainer.output_dir / "summary.txt").exists()


def test_rollout_and_trainer_log_probs_agree_on_cpu(make_trainer):
    trainer = make_trainer()
    metrics = trainer.train_step()
    # Same model, same temperature, KV-cache decode vs full forward: fp32 rounding only.
    assert metrics["mismatch/abs_diff_max"] < 1e-4
    assert metrics["mismatch/ess"] == pytest.approx(1.0, abs=1e-6)


def test_bf16_run_is_finite(make_trainer):
    trainer = make_trainer("precision.dtype=bf16", "train.steps=2")
    trainer.train()
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_fp16_with_master_weights_and_loss_scaling(make_trainer):
    trainer = make_trainer("precision.dtype=fp16", "precision.master_weights_fp32=true", "train.steps=2")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert all(m.dtype == torch.float32 for m in trainer.precision.masters)
    assert trainer.precision.scale > 1.0
    changed = sum(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert changed > 0
    for p, m in zip(trainer.model.parameters(), trainer.precision.masters):
        assert torch.equal(p, m.to(torch.float16))


@pytest.mark.compares_runs
def test_gradient_accumulation_matches_one_micro_batch(make_trainer):
    """Micro-batching changes nothing but rounding: the same update with 1 or 4 micro-batches
    (a reward that varies within groups: the built-in ones give an untrained model 0, a zero
    gradient, and any two layouts the same update)."""
    whole = make_trainer("train.micro_batch_size=16", "optim.grad_clip=null", rewards=[varied_reward])
    split = make_trainer("train.micro_batch_size=4", "optim.grad_clip=null", rewards=[varied_reward])
    starts = [{n: p.detach().clone() for n, p in t.model.named_parameters()} for t in (whole, split)]
    m1, m2 = whole.train_step(), split.train_step()
    for t, m, start, what in ((whole, m1, starts[0], "1 micro-batch"), (split, m2, starts[1], "4 micro-batches")):
        run_guard.assert_trained([m["grad_norm"]], start, dict(t.model.named_parameters()), what=what)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    for a, b in zip(whole.model.parameters(), split.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
