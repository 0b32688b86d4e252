"""Detectors that act: fixed bounds from the first step, calibrated thresholds (a default
fp32 demo run raises none), actions log / skip / stop, identical-samples causes, and a
non-finite current-policy log-prob as an event."""

from __future__ import annotations

import json

import pytest
import torch

from portarl.trainer import GRPOTrainer, TrainConfig, TrainingStopped, build_from_config
from portarl.trainer.guards.detectors import SpikeDetector
from portarl.trainer.phases.rollout import identical_cause
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


#: Pre-clip grad norms of the `make demo` run (60 steps, lr 1e-3), steps 31-60: heavy-tailed,
#: with healthy jumps to 9.4x the rolling median (step 52).
DEMO_GRAD_NORMS = (1.0, 1.97, 0.82, 1.03, 1.12, 7.62, 1.35, 0.89, 2.28, 2.54, 1.13, 0.84, 0.92, 1.16, 5.62, 1.54,
                   2.1, 2.32, 0.73, 1.32, 1.14, 11.58, 1.2, 5.09, 2.91, 0.81, 0.7, 2.95, 2.29, 1.42)


def test_ratio_ignores_the_heavy_tail_of_healthy_grad_norms():
    """The default thresholds on the demo's own grad norms: no spike (the 3x ratio of old
    flagged four of them); a 100x jump (a mis-scaled gradient) is one."""
    g = TrainConfig().guards
    det = SpikeDetector("grad_norm", g.spike_window, g.spike_min_history, g.spike_factor, g.grad_norm_ceiling,
                        g.grad_norm_floor, g.spike_ratio)
    for v in DEMO_GRAD_NORMS:
        assert det.update(v) is None, v
    assert det.update(100 * 1.4)["reason"] == "ceiling"
    det = SpikeDetector("grad_norm", g.spike_window, g.spike_min_history, g.spike_factor, None, g.grad_norm_floor,
                        g.spike_ratio)
    for v in DEMO_GRAD_NORMS:
        det.update(v)
    assert det.update(100 * 1.4)["reason"] == "relative"  # also without the fixed ceiling


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
    # repeated seeds: seeding, whatever the log-probs
    assert identical_cause([7] * 4 + [8] * 4, same, [[-1e-4] * 3] * 8, 4, 1e-4)[0] == "seeding"
    # distinct seeds, a completion of probability ~1 ("1+2=" -> "3<eos>"): a confident policy
    assert identical_cause(list(range(8)), same, [[-1e-4] * 3] * 8, 4, 1e-4)[0] == "confident"
    # distinct seeds, probability exp(-0.3) = 0.74 per completion: 4 draws repeat it with
    # chance 0.74^3 = 0.41, an ordinary event on a small answer space
    assert identical_cause(list(range(8)), same, [[-0.1] * 3] * 8, 4, 1e-4)[0] == "confident"
    # distinct seeds, probability exp(-2.1) = 0.12: 4 identical draws a 1.8e-3 chance ...
    assert identical_cause(list(range(8)), same, [[-0.7] * 3] * 8, 4, 1e-4)[0] == "confident"
    # ... and 8 identical draws a 4e-7 chance: the sampler ignores the seeds
    cause, why = identical_cause(list(range(8)), same, [[-0.7] * 3] * 8, 8, 1e-4)
    assert cause == "sampler" and "log-prob -2.1" in why, why
    # mixed groups: one identical group of a likely completion, the other varied
    mixed = [[5, 2]] * 4 + [[5, 2], [6, 2], [7, 2], [8, 2]]
    assert identical_cause(list(range(8)), mixed, [[-0.05, -0.01]] * 8, 4, 1e-4)[0] == "confident"


def test_identical_min_chance_validated():
    with pytest.raises(Exception, match="rollout.identical_min_chance"):
        TrainConfig.load(None, ["rollout.identical_min_chance=1.5"])


def test_constant_seed_is_named_as_seeding(make_trainer):
    trainer = make_trainer("rollout.seed_mode=constant")
    metrics = trainer.train_step()
    assert metrics["rollout/identical_group_frac"] > 0.2
    event = next(fields for kind, _, fields in metrics["_events"] if kind == "identical_samples")
    assert event["cause"] == "seeding"


def test_nonfinite_current_policy_logp_is_an_event(make_trainer, monkeypatch):
    import portarl.trainer.phases.update as update

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


def test_planted_100x_gradient_is_a_grad_norm_spike(make_trainer):
    """The loss (so every gradient) scaled 100x at one step after the detector's history
    has filled: a grad_norm spike at that step, with the default thresholds."""
    trainer = make_trainer("train.steps=8", rewards=[varied_reward])
    planted = 7
    trainer.hooks["loss"].append(lambda step, loss: loss * 100.0 if step == planted else loss)
    trainer.train()
    events = [json.loads(line) for line in (trainer.output_dir / "events.jsonl").read_text().splitlines()]
    spikes = {e["step"] for e in events if e["kind"] == "grad_norm_spike"}
    assert planted in spikes, events


def test_configs_saved_with_the_retired_collapse_entropy_still_load_and_resume(tmp_path):
    """Checkpoints and run directories written before ``rollout.identical_min_chance``
    replaced ``rollout.collapse_entropy`` still export (the state's config loads) and
    resume (the field is not a refused change)."""
    import yaml

    from portarl.trainer.run.output_dir import check_resume_config

    saved = TrainConfig().to_dict()
    del saved["rollout"]["identical_min_chance"]
    saved["rollout"]["collapse_entropy"] = 0.05
    assert TrainConfig.from_dict(saved).rollout.identical_min_chance == 1e-4
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    changes = check_resume_config(tmp_path, TrainConfig())
    assert changes == []  # a field the old config lacks, left at its default, is no change
