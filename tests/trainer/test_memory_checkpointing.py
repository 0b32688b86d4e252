"""Activation checkpointing and token-budget micro-batches change memory, not gradients:
one optimizer step's gradients equal the plain run's within fp32 rounding (LoRA on and
off), the checkpoint really recomputes in the update, and nothing recomputes (or loses its
KV cache) in the rollout and the no-grad scoring forwards."""

from __future__ import annotations

import pytest
import torch

import portarl.trainer.phases.update as update
from portarl.trainer import GRPOTrainer, build_from_config
from portarl.trainer.memory.checkpointing import checkpointing_enabled, wants_checkpointing
from portarl.trainer.config import ConfigError, TrainConfig

import run_guard
from trainer_fast import fast_config, varied_reward

#: Same math, other order of fp32 sums (recompute: none; smaller micro-batches: the
#: gradient accumulated over more backward passes, attention over fewer padding keys).
RTOL, ATOL = 1e-5, 1e-7
#: Varied prompt lengths (operands up to 3 digits) and completions, so packs differ in width.
VARIED = ["data.max_operand=999", "rollout.max_new_tokens=5", "optim.grad_clip=null", "train.steps=1",
          "train.old_logprobs=recompute", "loss.kl_coef=0.01"]


def _gradients(tmp_path, monkeypatch, *overrides, name) -> tuple[dict, GRPOTrainer]:
    """The gradients of the first optimizer step (captured where the optimizer would step)."""
    cfg = fast_config(tmp_path / name, *VARIED, *overrides)
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, [varied_reward], examples, cfg, device="cpu")
    grads: dict = {}

    def capture(tr):
        grads.update({n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None})
        return {}

    monkeypatch.setattr(update, "guarded_optimizer_step", capture)
    metrics = trainer.train_step()
    assert metrics["skipped"] == 0 and grads
    return grads, trainer


def _assert_same(a: dict, b: dict) -> None:
    """``b``'s gradients equal the reference ``a``'s, which must be finite and not all 0 (the
    guard of tests/run_guard.py: zero advantages give zero gradients in every layout)."""
    assert a.keys() == b.keys()
    run_guard.assert_gradient_flows(a, what="the reference layout's first-step gradients")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


class _Counter:
    """Forward calls of one decoder layer's MLP, split by autograd mode."""

    def __init__(self, module):
        self.grad = self.no_grad = 0
        module.register_forward_hook(self)

    def __call__(self, module, args, out):
        if torch.is_grad_enabled():
            self.grad += 1
        else:
            self.no_grad += 1


@pytest.mark.compares_runs
@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_gives_the_plain_gradients_and_recomputes(tmp_path, monkeypatch, lora):
    extra = ["model.lora.r=4"] if lora else []
    plain, _ = _gradients(tmp_path, monkeypatch, "train.gradient_checkpointing=false", *extra, name="plain")
    cfg = fast_config(tmp_path / "ckpt", *VARIED, "train.gradient_checkpointing=true", *extra)
    model, tokenizer, examples = build_from_config(cfg)
    layer = model.model.layers[0]
    counter = _Counter(layer.mlp)
    trainer = GRPOTrainer(model, tokenizer, [varied_reward], examples, cfg, device="cpu")
    assert checkpointing_enabled(trainer.model) and trainer.model.training
    grads: dict = {}
    monkeypatch.setattr(update, "guarded_optimizer_step", lambda tr: grads.update(
        {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}) or {})
    assert trainer.train_step()["skipped"] == 0
    _assert_same(plain, grads)
    # One micro-batch (8 rows <= micro_batch_size): its forward, and the recompute in the
    # backward, both with autograd on; the rollout's forwards and the old / reference
    # scoring ran once each, without autograd (no recompute there).
    assert counter.grad == 2, counter.grad
    assert counter.no_grad >= 3  # prefill + decode steps + the no-grad scoring forwards


def test_rollout_keeps_its_kv_cache_with_checkpointing_in_training_mode(tmp_path):
    """transformers drops the cache when a checkpointed layer runs with autograd: the hf
    engine decodes without autograd, so samples equal those of the plain model."""
    out = {}
    for flag in ("false", "true"):
        cfg = fast_config(tmp_path / flag, "rollout.max_new_tokens=6", f"train.gradient_checkpointing={flag}",
                          "rollout.lean_decode=false")
        model, tokenizer, examples = build_from_config(cfg)
        trainer = GRPOTrainer(model, tokenizer, [varied_reward], examples, cfg, device="cpu")
        prompts = [trainer.codec.encode_prompt(e.prompt) for e in examples[:3]]
        batch = trainer.rollout.generate(prompts, [1, 2, 3], trainer.sampling)
        out[flag] = (batch.completion_ids, batch.logprobs)
    assert out["true"] == out["false"]  # tokens and log-probs, bitwise


def test_auto_is_on_for_models_not_built_in():
    assert not wants_checkpointing(TrainConfig.load(None, []))
    assert wants_checkpointing(TrainConfig.load(None, ["model.path=/some/model"]))
    assert wants_checkpointing(TrainConfig.load(None, ["train.gradient_checkpointing=true"]))
    assert not wants_checkpointing(TrainConfig.load(None, ["model.path=/m", "train.gradient_checkpointing=false"]))
    with pytest.raises(ConfigError, match="train.gradient_checkpointing"):
        TrainConfig.load(None, ["train.gradient_checkpointing=sometimes"])
