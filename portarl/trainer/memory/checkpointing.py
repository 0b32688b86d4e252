"""Activation (gradient) checkpointing: ``train.gradient_checkpointing``.

Why: without it a step keeps every decoder layer's activations for the backward, which is
almost all of a real model's peak (SmolLM2-135M at the README settings: 13.5 GiB for 0.54 GB
of weights). With it each decoder layer keeps only its input and recomputes its forward
during the backward: roughly one more forward per step for ``layers x`` less saved memory.

How: per decoder layer, non-reentrant ``torch.utils.checkpoint``, through the model's own
switch (``activation_checkpointing_enable``, the new name of ``gradient_checkpointing_enable``,
with ``use_reentrant=False``). Transformers checkpoints each layer's ``forward``, not its
``__call__``, so module hooks stay outside the checkpoint; under FSDP2 the switch is thrown
before ``fully_shard`` (:func:`portarl.trainer.start.setup.place_model`): FSDP2's pre-forward /
pre-backward hooks all-gather the layer once for the forward and once for the backward, and
the recompute runs inside the backward's all-gather instead of gathering again. This is the
ordering torch's FSDP2 documentation gives for its own ``checkpoint_wrapper``; the model's own
switch gives it without renaming parameters (``_checkpoint_wrapped_module``), so checkpoints,
resume and export see the same names with checkpointing on or off.

The checkpoint applies only in training mode with autograd on (transformers checks
``self.training and torch.is_grad_enabled()``): the rollout and the no-grad scoring forwards
(old / reference log-probs) run each layer once, their KV cache untouched; the trainer keeps
the model in training mode for its update forwards.

LoRA: the adapter sits inside checkpointed layers whose inputs come from frozen embeddings;
input gradients are switched on (``enable_input_require_grads``) so the recompute is part
of the graph whatever checkpoint flavour runs.

Gradients equal the plain run's within fp32 rounding (the recompute replays the same ops on
the same inputs; ``tests/trainer/test_memory_checkpointing.py``).
"""

from __future__ import annotations

import logging

log = logging.getLogger("portarl.train")

def wants_checkpointing(cfg) -> bool:
    """Whether a run with ``cfg`` (a TrainConfig) checkpoints activations: ``auto`` turns it
    on for every model not built in by portarl (the tiny models are too small to gain)."""
    value = cfg.train.gradient_checkpointing
    if value == "auto":
        from portarl.assets.tokenizer import BUILTIN_MODELS

        return cfg.model.path not in BUILTIN_MODELS
    return bool(value)


def _base(model):
    """The transformers model under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def enable_checkpointing(model) -> None:
    """Per-layer non-reentrant activation checkpointing on ``model`` (a transformers model,
    or a peft model around one), with input gradients on. Raises ValueError naming the
    setting for a model that cannot checkpoint."""
    base = _base(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"train.gradient_checkpointing: {type(base).__name__} does not support activation "
                         "checkpointing; set train.gradient_checkpointing=false")
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # pragma: no cover - older transformers
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(base, "enable_input_require_grads"):
        base.enable_input_require_grads()


def checkpointing_enabled(model) -> bool:
    """Whether any module of ``model`` checkpoints its activations (for logs and tests)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in _base(model).modules())


__all__ = ["checkpointing_enabled", "enable_checkpointing", "wants_checkpointing"]
