"""Token truth of multi-turn episodes (issue 37): the trainer scores exactly the tokens the
engine sampled. The trainer's log-probs of a multi-turn trajectory equal the engine's at
staleness 0 within the rollout fp32 tolerance, and the same check fails for an episode loop
that re-tokenises the model's turns from their text."""

from __future__ import annotations

import pytest
import torch

from agent_tiny import agent_tokenizer, talkative_model
from portarl.assets.data import Example
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL
from portarl.multiturn.episode import EpisodeRunner
from portarl.trainer import GRPOTrainer
from portarl.trainer.phases.rollout import run_rollout
from portarl.trainer.phases.sequences import build_batch, completion_logprobs, padded
from trainer_fast import fast_config


def token_truth_gap(trainer, rollout) -> float:
    """max |trainer log-prob - engine log-prob| over the model's tokens of ``rollout``."""
    batch = build_batch(rollout.prompt_ids, rollout.completion_ids, trainer.codec.pad_token_id, "cpu",
                        model_mask=rollout.model_mask)
    with torch.no_grad():
        trainer_logp = completion_logprobs(trainer.model, batch, temperature=trainer.config.rollout.temperature)
    engine_logp = padded(rollout.logprobs, batch.labels.shape[1], 0.0, torch.float32)
    return float((trainer_logp - engine_logp).abs()[batch.mask].max())


class RetokenisingRunner(EpisodeRunner):
    """The bug this guards against: each model turn kept as its text and tokenised again
    (as rendering the conversation through the chat template does), the engine's log-probs
    kept position by position."""

    def _after_turn(self, ep, ids, logprobs, ended, last):
        tok = self.codec.tokenizer
        again = tok(tok.decode(list(ids), skip_special_tokens=False), add_special_tokens=False)["input_ids"]
        super()._after_turn(ep, again, (list(logprobs) + [0.0] * len(again))[: len(again)], ended, last)


@pytest.fixture
def trainer(tmp_path):
    tok = agent_tokenizer()
    cfg = fast_config(tmp_path, "environment=agent_tools:CountEnv", "rewards=[{name: environment}]",
                      "rollout.max_turns=3", "rollout.max_new_tokens=12", "train.prompts_per_step=4")
    examples = [Example([{"role": "user", "content": f"Count {i}"}], None, {}, f"row {i}") for i in range(4)]
    return GRPOTrainer(talkative_model(tok), tok, None, examples, cfg, device="cpu")


def test_trainer_logprobs_of_a_multiturn_trajectory_are_the_engines(trainer):
    rollout = run_rollout(trainer, 1).rollout
    # multi-turn for real: episodes of several turns, context tokens between model tokens
    assert max(e["turns"] for e in rollout.episodes) >= 2
    assert any(not all(m) and m[-1] for m in rollout.model_mask)
    assert token_truth_gap(trainer, rollout) < ROLLOUT_FP32_ATOL


def test_the_check_fails_when_a_turn_is_retokenised(trainer, monkeypatch):
    import portarl.trainer.phases.episodes as episodes

    monkeypatch.setattr(episodes, "EpisodeRunner", RetokenisingRunner)
    rollout = run_rollout(trainer, 1).rollout
    assert max(e["turns"] for e in rollout.episodes) >= 2
    assert token_truth_gap(trainer, rollout) > ROLLOUT_FP32_ATOL, "a re-tokenised turn went unnoticed"
