"""Routing replay for mixture-of-experts models (issue 48, ``rollout.routing_replay:
rollout``, R3): the hf engine records the experts of every token it fed; the trainer's
forwards use them, with the gate weights recomputed by the current router.

The engine here is made to route otherwise than the trainer would on some tokens (its
choice taken from noisy probabilities, as an engine whose router kernel rounds
differently does on near-ties; the gate values stay the router's). With replay, the
trainer's log-probs equal the engine's at staleness 0 within the fp32 rollout tolerance
and ``rollout/routing_agreement`` reports the disagreement; a trainer that ignores the
recorded experts misses by more than that tolerance."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

from portarl.moe import routing  # noqa: E402
from portarl.moe.models import BUILTIN_MOES, build_tiny_moe  # noqa: E402
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL  # noqa: E402
from portarl.trainer import GRPOTrainer  # noqa: E402
from portarl.assets.data import arithmetic_examples  # noqa: E402
from trainer_fast import fast_config, varied_reward  # noqa: E402


def _noisy_choice(seed: int):
    """An engine's own top-k, from probabilities with noise added (the router's gate values untouched)."""
    gen = torch.Generator().manual_seed(seed)
    original = routing.choose

    def choose(probs, k):
        noise = torch.rand(probs.shape, generator=gen) * 0.2
        return original(probs + noise.to(probs.device), k)

    return choose


def _trainer(tmp_path, name, *overrides):
    model, tokenizer = build_tiny_moe(name, seed=3)
    cfg = fast_config(tmp_path, "rollout.routing_replay=rollout", "train.steps=1", "rollout.max_new_tokens=6",
                      *overrides)
    trainer = GRPOTrainer(model, tokenizer, [varied_reward], arithmetic_examples(16, seed=0), cfg, device="cpu")
    engine = trainer.rollout
    generate = engine.generate

    def disagreeing(*args, **kwargs):  # the engine routes otherwise on some tokens
        with pytest.MonkeyPatch.context() as m:
            m.setattr(routing, "choose", _noisy_choice(0))
            return generate(*args, **kwargs)

    engine.generate = disagreeing
    return trainer


@pytest.mark.parametrize("name", list(BUILTIN_MOES))
@pytest.mark.parametrize("layout", ["padded", "padding-free", "shared-prompt"])
def test_replayed_routing_gives_the_engines_log_probs(tmp_path, name, layout):
    """Shared-prompt rows share a prompt only where the engine routed its copies alike."""
    sets = {"padded": ["train.padding_free=false"], "padding-free": ["train.padding_free=true", "train.share_prompt=false"],
            "shared-prompt": ["train.padding_free=true", "train.share_prompt=true"]}[layout]
    trainer = _trainer(tmp_path, name, *sets)
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert 0.0 < metrics["rollout/routing_agreement"] < 1.0, metrics["rollout/routing_agreement"]  # made to disagree
    assert metrics["mismatch/abs_diff_max"] <= ROLLOUT_FP32_ATOL, metrics["mismatch/abs_diff_max"]


def test_ignoring_the_recorded_experts_misses_by_more_than_the_tolerance(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "tiny-qwen3-moe")
    monkeypatch.setattr(routing, "set_replay", lambda *args, **kwargs: None)  # the trainer routes by itself
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert metrics["mismatch/abs_diff_max"] > ROLLOUT_FP32_ATOL


def test_the_router_still_learns_under_replay(tmp_path):
    trainer = _trainer(tmp_path, "tiny-qwen3-moe")
    before = [r.weight.detach().clone() for r in routing.routers(trainer.model)]
    try:
        trainer.train_step()
    finally:
        trainer.close()
    assert any(not torch.equal(b, r.weight) for b, r in zip(before, routing.routers(trainer.model)))


def test_replay_on_a_dense_model_is_refused_naming_the_setting(tmp_path):
    from portarl.trainer import build_from_config
    from portarl.trainer.config.fields import ConfigError

    cfg = fast_config(tmp_path, "rollout.routing_replay=rollout", "train.steps=1")
    model, tokenizer, examples = build_from_config(cfg)
    assert routing.routers(model) == []
    with pytest.raises(ConfigError, match="no mixture-of-experts routers"):
        GRPOTrainer(model, tokenizer, [varied_reward], examples, cfg, device="cpu")


@pytest.mark.parametrize("replay", [True, False])
def test_on_policy_the_corrected_loss_is_zero_only_with_replay(tmp_path, monkeypatch, replay):
    """seq-mean-token-mean on-policy: each sequence's ratio is 1 and group-normalised
    advantages sum to zero, so the policy loss is 0, but the mismatch correction weighs
    each token by exp(old - rollout). With replay those weights are 1 (the engine's and the
    trainer's log-probs agree); with the recorded experts ignored they are not, and the
    loss moves off zero, on an engine made to route otherwise."""
    trainer = _trainer(tmp_path, "tiny-qwen3-moe", "loss.loss_agg_mode=seq-mean-token-mean")
    if not replay:
        monkeypatch.setattr(routing, "set_replay", lambda *args, **kwargs: None)
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert metrics["grad_norm"] > 1e-3
    if replay:
        assert abs(metrics["pg/loss"]) < 1e-6, metrics["pg/loss"]
    else:
        assert abs(metrics["pg/loss"]) > 1e-5, metrics["pg/loss"]


def test_a_deep_copy_routes_with_its_own_router(tmp_path):
    """The KL reference is a deep copy of the policy: its routers must use their own
    (frozen) weights, not the policy's, once the policy's have moved."""
    import copy

    model, _ = build_tiny_moe("tiny-qwen3-moe", seed=1)
    routing.install(model)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for r in routing.routers(model):
            r.weight.mul_(-1.0)  # the policy's routers move; the reference's must not follow
    hidden = torch.randn(5, model.config.hidden_size)
    for mine, theirs in zip(routing.routers(model), routing.routers(ref)):
        assert torch.equal(theirs(hidden)[0], torch.nn.functional.linear(hidden, theirs.weight))
        assert not torch.equal(mine(hidden)[0], theirs(hidden)[0])
