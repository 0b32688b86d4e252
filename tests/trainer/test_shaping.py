"""Length shaping: DAPO's soft overlong punishment against the paper's formula, and TRL's
truncated-completion masking through a real (tiny) training step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from portarl.trainer.phases import iteration as grpo
from portarl.trainer.config import ConfigError
from portarl.trainer.phases.shaping import overlong_penalty
from trainer_fast import fast_config


def test_overlong_penalty_is_dapo_eq13():
    # L_max = 10, L_cache = 4: 0 up to 6 tokens, then linear to -factor at 10.
    got = overlong_penalty([1, 6, 7, 8, 9, 10], 10, 4, 0.5)
    expected = [0.0, 0.0, -0.5 * 1 / 4, -0.5 * 2 / 4, -0.5 * 3 / 4, -0.5]
    assert got.tolist() == pytest.approx(expected, abs=1e-7)
    assert overlong_penalty([10, 3], 10, 0, 1.0).tolist() == [0.0, 0.0]  # off


def test_overlong_buffer_larger_than_budget_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="shaping.overlong_buffer"):
        fast_config(tmp_path, "shaping.overlong_buffer=9")  # max_new_tokens is 3


def _capture(trainer, monkeypatch, finished=None):
    """The rollout batch of the step, and the scored batch the update received.
    ``finished``: ``fn(i) -> bool`` overriding the engine's flags (an untrained tiny model
    rarely emits its end token, so the test chooses which completions count as truncated)."""
    seen = {}
    engine = trainer.rollout
    real_generate = engine.generate

    def generate(*args, **kwargs):
        batch = real_generate(*args, **kwargs)
        if finished is not None:
            batch = dataclasses.replace(batch, finished=[finished(i) for i in range(len(batch.finished))])
        seen["rollout"] = batch
        return batch

    monkeypatch.setattr(engine, "generate", generate)
    real_update = grpo.run_update

    def update(trainer_, scored, metrics, events):
        seen["scored"] = scored
        return real_update(trainer_, scored, metrics, events)

    monkeypatch.setattr(grpo, "run_update", update)
    return seen


def test_overlong_penalty_is_added_to_the_rewards(make_trainer, monkeypatch):
    trainer = make_trainer("shaping.overlong_buffer=2", "shaping.overlong_penalty_factor=0.8", "rollout.max_new_tokens=3",
                           rewards=[lambda prompt, completion, answer: 1.0])
    seen = _capture(trainer, monkeypatch)
    metrics = trainer.train_step()
    lengths = [len(c) for c in seen["rollout"].completion_ids]
    expected = [1.0 + 0.8 * min(0.0, (1 - n) / 2) for n in lengths]
    assert trainer.last_samples["total"] == pytest.approx(expected)
    assert any(n > 1 for n in lengths)  # the penalty did something
    assert metrics["shaping/overlong_frac"] == pytest.approx(sum(n > 1 for n in lengths) / len(lengths))
    assert metrics["shaping/overlong_penalty_mean"] == pytest.approx(sum(expected) / len(expected) - 1.0)


def test_truncated_completions_leave_the_loss(make_trainer, monkeypatch):
    from trainer_fast import varied_reward

    trainer = make_trainer("shaping.mask_truncated_completions=true", "rollout.max_new_tokens=2", rewards=[varied_reward])
    seen = _capture(trainer, monkeypatch, finished=lambda i: i % 3 == 0)
    metrics = trainer.train_step()
    finished = torch.tensor(seen["rollout"].finished)
    mask = seen["scored"].batch.mask
    assert 0 < int(finished.sum()) < len(finished), "the test needs both finished and truncated completions"
    assert not mask[~finished].any()  # truncated: out of the loss
    assert mask[finished].any(dim=-1).all()  # finished ones stay (their groups have reward spread)
    assert metrics["shaping/truncated_masked_frac"] == pytest.approx(float((~finished).float().mean()))


def test_overlong_penalty_matches_trl_soft_overlong_punishment():
    """TRL 1.16 has the same DAPO term as a reward function (factor 1); same lengths, same values."""
    trl_rewards = pytest.importorskip("trl.rewards", reason="TRL is not installed")
    fn = trl_rewards.get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=6)
    lengths = list(range(0, 21))
    theirs = fn([[1] * n for n in lengths])
    ours = overlong_penalty(lengths, 20, 6, 1.0).tolist()
    assert ours == pytest.approx(theirs, abs=1e-7)
