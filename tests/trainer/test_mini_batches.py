"""PPO mini-batches: mini_batches x ppo_epochs optimizer steps per rollout, shuffled with
the run seed; metrics per step as mean / first / last; the clip range then binds; a fault
in a later optimizer step leaves exactly the earlier steps applied, and says so."""

from __future__ import annotations

import copy

import pytest
import torch

import run_guard
from portarl.trainer import GRPOTrainer, build_from_config
from portarl.trainer.phases.update import lr_lambda, mini_batch_rows, optimizer_steps_total
from trainer_fast import fast_config, varied_reward




def _trainer(tmp_path, *overrides, name="run"):
    cfg = fast_config(tmp_path / name, *overrides)
    model, tokenizer, examples = build_from_config(cfg)
    return GRPOTrainer(model, tokenizer, [varied_reward], examples, cfg, device="cpu")


def test_mini_batch_rows_partition_and_determinism():
    parts = mini_batch_rows(16, 4, seed=3, step=2, epoch=0)
    assert len(parts) == 4 and all(p.numel() == 4 for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(16))
    again = mini_batch_rows(16, 4, seed=3, step=2, epoch=0)
    assert all(torch.equal(a, b) for a, b in zip(parts, again))
    other = mini_batch_rows(16, 4, seed=3, step=2, epoch=1)
    assert not all(torch.equal(a, b) for a, b in zip(parts, other))
    assert mini_batch_rows(16, 1, seed=3, step=2, epoch=0) == [slice(0, 16)]


def test_lr_schedule_counts_optimizer_steps(tmp_path):
    cfg = fast_config(tmp_path, "train.ppo_epochs=2", "train.mini_batches=2", "optim.schedule=cosine",
                      "optim.warmup_ratio=0.25")
    total = optimizer_steps_total(cfg)
    assert total == cfg.train.steps * 4
    factor = lr_lambda(cfg, total)
    assert [factor(i) for i in range(3)] == [pytest.approx(1 / 3), pytest.approx(2 / 3), 1.0]  # warm-up: 3 steps
    assert factor(total) == pytest.approx(cfg.optim.min_lr_ratio)


@pytest.mark.compares_runs
def test_clip_fractions_bind_and_respond_to_the_clip_range(tmp_path):
    runs = {}
    for eps in ("0.28", "0.02"):
        trainer = _trainer(tmp_path, "train.mini_batches=4", "train.steps=1", f"loss.clip_eps_high={eps}",
                           "optim.lr=3e-3", name=eps)
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        runs[eps] = trainer.train_step()
        run_guard.assert_trained([runs[eps]["grad_norm"]], start, dict(trainer.model.named_parameters()),
                                 what=f"loss.clip_eps_high={eps}")
    for metrics in runs.values():
        assert metrics["update/applied_steps"] == 4
        assert metrics["pg/clip_frac_high/first"] == 0.0  # on-policy: ratio 1
        assert metrics["pg/approx_kl/first"] == pytest.approx(0.0, abs=1e-6)
    assert runs["0.28"]["pg/clip_frac_high"] >= 0.0
    assert runs["0.02"]["pg/clip_frac_high"] > 0.0
    assert runs["0.02"]["pg/clip_frac_high"] > runs["0.28"]["pg/clip_frac_high"]


def _state(trainer):
    return ({n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            copy.deepcopy(trainer.optimizer.state_dict()))


@pytest.mark.compares_runs
def test_nan_in_second_epoch_keeps_exactly_the_first_step(tmp_path):
    """ppo_epochs=2 with a NaN gradient in epoch 2: the weights and optimizer state equal
    those of the same run with ppo_epochs=1 (the first step applied, the second not), and
    the event says so instead of "untouched"."""
    two = _trainer(tmp_path, "train.ppo_epochs=2", "optim.grad_clip=null", name="two")
    one = _trainer(tmp_path, "train.ppo_epochs=1", "optim.grad_clip=null", name="one")
    calls = []

    def nan_on_second_call(step, grad):
        calls.append(step)
        if len(calls) == 2:
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
        return grad

    two.hooks["grad"].append(nan_on_second_call)
    start = {n: p.detach().clone() for n, p in one.model.named_parameters()}
    m2, m1 = two.train_step(), one.train_step()
    run_guard.assert_trained([m1["grad_norm"]], start, dict(one.model.named_parameters()), what="ppo_epochs=1")
    assert m1["skipped"] == 0 and m2["skipped"] == 0 and m2["update/applied_steps"] == 1
    assert m2["guard/nonfinite_tensor"] == "gradient" and m2["guard/consecutive_skips"] == 1
    event = next(msg for kind, msg, _ in m2["_events"] if kind == "partial_update")
    assert "optimizer step 2 of 2 (epoch 2, mini-batch 1)" in event and "first 1 optimizer steps stay applied" in event
    assert not any(kind == "skipped_step" for kind, _, _ in m2["_events"])
    (p2, o2), (p1, o1) = _state(two), _state(one)
    for name in p1:
        assert torch.equal(p1[name], p2[name]), name
    assert o1["state"].keys() == o2["state"].keys()
    for key in o1["state"]:
        for field, value in o1["state"][key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(o2["state"][key][field])), (key, field)
