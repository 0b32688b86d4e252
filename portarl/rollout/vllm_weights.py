"""The trainer's weights as the colocated vllm engine takes them, in memory.

One process: the model's own tensors (LoRA folded in aside, :func:`portarl.assets.lora.merged_tensors`),
handed over as a list of references, no copies.

Under torchrun (FSDP2, one engine per rank through vLLM's external launcher) every
parameter is a DTensor shard, and every rank's engine needs the full tensor. The
generator :func:`gathered_weights` gathers them with ``DTensor.full_tensor()`` (an
all-gather, so every rank runs it, in the same order: the state dict's) a bucket of
``rollout.sync_bucket_mb`` at a time, and is handed to ONE in-place ``reload_weights`` per
sync, which consumes it while it loads: no file, no RPC per tensor, and at most one bucket
of gathered tensors (or one tensor larger than a bucket) alive on a rank beyond the
engine's own weights.

One reload per version matters: vLLM's layerwise reload
(``vllm/model_executor/model_loader/reload/layerwise.py:254-270``, vLLM 0.32) gives a layer
that received no weights its old tensors back and processes a layer that received some
with what it has, so a stream cut in the middle (an exception in a gather) leaves a silent
mix of two versions: :class:`~portarl.rollout.vllm.VLLMRollout` then refuses to generate
until a sync completes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from portarl.assets.lora import merged_tensors

MIB = 1 << 20


def _engine_state(model: torch.nn.Module, skip=frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` the engine loads, one at a time: the merged weights
    (:func:`portarl.assets.lora.merged_tensors`) without a tied output head (vLLM ties it to the
    embedding itself) and without the names in ``skip`` (neither gathered nor sent). Under
    FSDP2 each is gathered whole (an all-gather: every rank, this order), a LoRA layer
    folded from its gathered base weight and adapter."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    return merged_tensors(model, skip=frozenset(skip) | ({"lm_head.weight"} if tied else frozenset()))


def frozen_vision_names(model: torch.nn.Module) -> frozenset:
    """The state-dict names of a vision-language model's frozen vision tower
    (``model.freeze_vision``: its parameters without grad, and its persistent buffers), which no
    optimizer step changes: sent to the engine once, not every version. Empty for a text
    model. LoRA adapts the language model only, so the tower's names are the same in the
    merged state (``base_layer`` never appears under it)."""
    from portarl.assets.lora import base_model
    from portarl.vision.models import is_vision_model, vision_parts

    if not is_vision_model(model):
        return frozenset()
    tower, _ = vision_parts(model)
    prefix = next(name for name, module in base_model(model).named_modules() if module is tower)
    trained = {n for n, p in tower.named_parameters() if p.requires_grad}
    return frozenset(f"{prefix}.{n}" for n in tower.state_dict() if n not in trained)


def local_weights(model: torch.nn.Module, skip=frozenset()) -> list[tuple[str, torch.Tensor]]:
    """One process: the engine's weights as references to the model's tensors."""
    return list(_engine_state(model, skip))


def is_sharded(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def gathered_weights(model: torch.nn.Module, *, dtype: torch.dtype | None = None, bucket_mb: float = 256.0,
                     skip=frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every engine weight of an FSDP2 ``model``, gathered a
    bucket of ``bucket_mb`` MiB at a time (collective: every rank must exhaust it, in step),
    floating-point tensors cast to ``dtype`` (the engine's: FSDP2 may hold fp32 masters
    under a bf16 / fp16 compute policy, whose forward casts them the same way)."""
    if bucket_mb <= 0:
        raise ValueError(f"rollout.sync_bucket_mb must be positive, got {bucket_mb}")
    limit = bucket_mb * MIB
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in _engine_state(model, skip):
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= limit:
            yield from bucket
            bucket, size = [], 0
    yield from bucket


class Counted:
    """An iterator over (name, tensor) pairs that counts what the engine took (``count``)."""

    def __init__(self, weights):
        self._it, self.count = iter(weights), 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._it)
        self.count += 1
        return item
