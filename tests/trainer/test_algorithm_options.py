"""The algorithm options through a real (tiny) training step: each reaches the loss and
shows in the metrics."""

from __future__ import annotations

import math

import pytest

from trainer_fast import varied_reward


@pytest.mark.parametrize("loss", ["cispo", "sapo"])
def test_new_losses_train(make_trainer, loss):
    trainer = make_trainer(f"loss.policy_loss={loss}", rewards=[varied_reward])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step()
    assert math.isfinite(metrics["loss"]) and metrics["skipped"] == 0
    assert any((p.detach() != b).any() for p, b in zip(trainer.model.parameters(), before))
    key = "pg/clip_frac_high" if loss == "cispo" else "pg/sapo_gate_mean"
    assert key in metrics


def test_entropy_masking_in_training_keeps_q(make_trainer):
    trainer = make_trainer("loss.top_entropy_quantile=0.25", "rollout.max_new_tokens=6", rewards=[varied_reward])
    metrics = trainer.train_step()
    # Per micro-batch within one token of q: over 16-token micro-batches at least, the mean share is near q.
    assert metrics["pg/entropy_kept_frac"] == pytest.approx(0.25, abs=1 / 16)
