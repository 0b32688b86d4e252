"""DAPO dynamic sampling: rounds until every group of the batch is informative, fresh seeds
each round (never repeated), the cap and its event, and the metrics."""

from __future__ import annotations

import pytest

import run_guard
from portarl.rollout import request_seeds
from portarl.trainer.phases.dynamic_sampling import informative, round_seeds
from trainer_fast import varied_reward

import torch


def half_uniform(prompt, completion, answer):
    """Uniform (uninformative) for prompts with an even answer, varied for the others."""
    return 1.0 if int(answer) % 2 == 0 else varied_reward(prompt, completion, answer)


def constant(prompt, completion, answer):
    return 1.0


def _record_seeds(trainer, monkeypatch):
    calls = []
    engine = trainer.rollout
    real = engine.generate

    def generate(prompts, seeds, params):
        calls.append(list(seeds))
        return real(prompts, seeds, params)

    monkeypatch.setattr(engine, "generate", generate)
    return calls


def test_round_seeds_never_repeat_across_rounds_and_steps():
    seen = [s for step in (1, 2, 3) for r in range(6) for s in round_seeds(0, step, r, 4, 8, "per_sample")]
    assert len(set(seen)) == len(seen)
    assert round_seeds(7, 5, 0, 3, 4, "per_sample") == request_seeds(7, 5, 3, 4)  # round 0: the ordinary rollout


def test_informative():
    assert informative(torch.tensor([0.0, 1.0])) and not informative(torch.tensor([0.5, 0.5, 0.5]))


def test_batch_holds_only_informative_groups(make_trainer, monkeypatch):
    trainer = make_trainer("rollout.dynamic_sampling=true", "train.prompts_per_step=4", rewards=[half_uniform])
    calls = _record_seeds(trainer, monkeypatch)
    metrics = trainer.train_step()
    g = trainer.config.rollout.group_size
    rounds = metrics["rollout/rounds"]
    assert rounds == len(calls) >= 2, "the test needs a step with more than one round"
    total = torch.tensor(trainer.last_samples["total"])
    assert total.numel() == 4 * g
    assert all(informative(total[i : i + g]) for i in range(0, total.numel(), g))
    assert all(a != 0 for a in trainer.last_samples["advantages"][::g])
    every = [s for c in calls for s in c]
    assert len(set(every)) == len(every)  # fresh per-sample seeds in every round
    assert 0 < metrics["rollout/informative_frac"] < 1
    assert metrics["rollout/generated_groups"] == 4 * rounds
    assert metrics["rollout/informative_frac"] >= 4 / metrics["rollout/generated_groups"]
    assert not any(kind == "dynamic_sampling_cap" for kind, _, _ in metrics["_events"])
    assert metrics["skipped"] == 0


def test_cap_hit_logs_an_event_and_masks_the_filler(make_trainer, monkeypatch):
    trainer = make_trainer("rollout.dynamic_sampling=true", "rollout.max_generation_rounds=3", rewards=[constant])
    calls = _record_seeds(trainer, monkeypatch)
    seen = {}
    from portarl.trainer.phases import iteration as grpo

    real_update = grpo.run_update

    def update(trainer_, scored, metrics, events):
        seen["mask"] = scored.batch.mask
        return real_update(trainer_, scored, metrics, events)

    monkeypatch.setattr(grpo, "run_update", update)
    metrics = trainer.train_step()
    assert metrics["rollout/rounds"] == 3 == len(calls)
    assert metrics["rollout/informative_frac"] == 0
    events = [(kind, message) for kind, message, _ in metrics["_events"] if kind == "dynamic_sampling_cap"]
    assert len(events) == 1 and "rollout.max_generation_rounds=3" in events[0][1]
    assert not seen["mask"].any()  # uniform filler groups are out of the loss


def test_off_by_default_is_one_round(make_trainer, monkeypatch):
    trainer = make_trainer(rewards=[half_uniform])
    calls = _record_seeds(trainer, monkeypatch)
    metrics = trainer.train_step()
    assert len(calls) == 1 and "rollout/rounds" not in metrics


def test_bad_cap_is_refused(tmp_path):
    from portarl.trainer.config import ConfigError
    from trainer_fast import fast_config

    with pytest.raises(ConfigError, match="rollout.max_generation_rounds"):
        fast_config(tmp_path, "rollout.max_generation_rounds=0")


@pytest.mark.compares_runs
def test_one_informative_round_is_the_ordinary_step(make_trainer):
    """When round 0 is informative everywhere, dynamic sampling changes nothing: same loss."""
    results = []
    for on in ("false", "true"):
        trainer = make_trainer(f"rollout.dynamic_sampling={on}", rewards=[varied_reward])
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        results.append(trainer.train_step())
        run_guard.assert_trained([results[-1]["grad_norm"]], start, dict(trainer.model.named_parameters()),
                                 what=f"rollout.dynamic_sampling={on}")
    off, on_ = results
    assert on_["rollout/rounds"] == 1 and on_["rollout/informative_frac"] == 1
    assert on_["loss"] == off["loss"] and on_["reward/mean"] == off["reward/mean"]
