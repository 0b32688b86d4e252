"""Detectors that act: fixed bounds from the first step, calibrated thresholds (a default
fp32 demo run raises none), actions log / skip / stop, identical-samples causes, and a
non-finite current-policy log-prob as an event."""

from __future__ import annotations

import json

import pytest
import torch

from portarl.trainer import GRPOTrainer, TrainConfig, TrainingStopped, build_from_config
from portarl.trainer.guards import SpikeDetector
from portarl.trainer.rollout_phase import identical_cause
from trainer_fast import fast_config, varied_reward




def _trainer(tmp_path, *overrides):
    cfg = fast_config(tmp_path, *overrides)
    model, tokenizer, examples = build_from_config(cfg)
    return GRPOTrainer(model, tokenizer, [varied_reward], examples, cfg, device="cpu")


def test_ceiling_judges_the_first_steps():
    det = SpikeDetector("grad_norm", window=20, min_history=5, factor=6.0, ceiling=50.0, floor=1.0)
    event = det.update(155.0)  # the unflagged step-1 grad norm
    assert event is not None and event["reason"] == "ceiling"
    assert det.update(3.0) is None


def test_floor_keeps_a_near_zero_history_quiet():
    det = SpikeDetector("kl", window=20, min_history=3, factor=6.0, floor=0.05)
    for v in (0.0, 1e-6, 2e-6, 1e-6):
        assert det.update(v) is None
    assert det.update(0.01) is None  # a jump from ~0, but below the noise floor
    assert det.update(0.5)["reason"] == "relative"


def test_ratio_ignores_step_to_step_noise():
    """The default fp32 demo's grad norms (0.6-3 from step to step): no relative spike with
    ratio 3; a 10x jump is one."""
    det = SpikeDetector("grad_norm", window=20, min_history=5, factor=6.0, floor=1.0, ratio=3.0)
    for v in (0.77, 1.73, 0.74, 1.25, 0.96, 0.80, 1.70, 1.23, 1.69, 0.94, 1.62, 1.55, 1.88, 2.98, 2.35):
        assert det.update(v) is None, v
    assert det.update(15.0)["reason"] == "relative"


def test_default_fp32_demo_raises_no_spike(tmp_path):
    """The built-in demo as `portarl train` runs it (default model, data, warm-up), shortened."""
    cfg = TrainConfig.load(None, [f"output_dir={tmp_path / 'demo'}", "train.steps=12", "logging.progress=false",
                                  "logging.tensorboard=false", "logging.plot=false"])
    model, tokenizer, examples = build_from_config(cfg)
    GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu").train()
    events = [json.loads(line) for line in (tmp_path / "demo" / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["kind"].endswith("_spike")], events


@pytest.mark.parametrize("action", ["skip", "stop"])
def test_spike_actions_refuse_the_step(tmp_path, action):
    trainer = _trainer(tmp_path, "guards.grad_norm_ceiling=1e-9", f"guards.spike_action={action}", "train.steps=3")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    if action == "skip":
        metrics = trainer.train_step()
        assert metrics["skipped"] == 1 and metrics["guard/nonfinite_tensor"] == "grad_norm_spike"
        assert metrics["guard/spike"] == 1
        assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    else:
        with pytest.raises(TrainingStopped, match="grad_norm_spike") as err:
            trainer.train()
        assert err.value.checkpoint is not None and err.value.checkpoint.name == "step-000001"
        assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_spike_action_log_only_logs(tmp_path):
    trainer = _trainer(tmp_path, "guards.grad_norm_ceiling=1e-9")
    metrics = trainer.train_step()
    assert metrics["skipped"] == 0 and metrics["guard/spike"] == 1
    assert any(kind == "grad_norm_spike" for kind, _, _ in metrics["_events"])


def test_identical_samples_causes():
    same = [[5, 6, 2]] * 8
    assert identical_cause([7] * 4 + [8] * 4, same, [[-0.5] * 3] * 8, 4, 0.05)[0] == "seeding"
    assert identical_cause(list(range(8)), same, [[-1e-4] * 3] * 8, 4, 0.05)[0] == "collapse"
    assert identical_cause(list(range(8)), same, [[-0.7] * 3] * 8, 4, 0.05)[0] == "unknown"


def test_constant_seed_is_named_as_seeding(make_trainer):
    trainer = make_trainer("rollout.seed_mode=constant")
    metrics = trainer.train_step()
    assert metrics["rollout/identical_group_frac"] > 0.2
    event = next(fields for kind, _, fields in metrics["_events"] if kind == "identical_samples")
    assert event["cause"] == "seeding"


def test_nonfinite_current_policy_logp_is_an_event(make_trainer, monkeypatch):
    import portarl.trainer.update as update

    real = update.logprobs

    def poisoned(trainer, model, batch, **kwargs):
        logp, entropy = real(trainer, model, batch, **kwargs)
        logp = logp.clone()
        row, col = torch.nonzero(batch.mask)[0].tolist()
        logp[row, col] = float("nan")
        return logp, entropy

    # Old log-probs from their own forward: only the current policy's token is NaN, it is
    # left out of the loss and reported.
    trainer = make_trainer("train.old_logprobs=recompute")
    monkeypatch.setattr(update, "logprobs", poisoned)
    metrics = trainer.train_step()
    assert metrics["guard/nonfinite_token_frac"] > 0
    assert any(kind == "nonfinite_logp" for kind, _, _ in metrics["_events"])
    # On-policy with train.old_logprobs=auto the old log-probs are that same forward's, so
    # they are NaN too: the old_logp guard skips the step, nothing applied.
    trainer = make_trainer()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train_step()
    assert metrics["skipped"] == 1 and metrics["guard/nonfinite_tensor"] == "old_logp"
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
