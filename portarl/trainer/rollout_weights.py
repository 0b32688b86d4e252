"""The policy's weights as a separate rollout process loads them (``rollout.mode: async``).

The rollout worker holds a plain copy of the base model (no adapters, not sharded) and
loads each published version with ``safetensors.torch.load_model(strict=True)``: every
name and shape is checked. What the trainer holds differs in three ways, each handled
here and nowhere else:

- **FSDP2 (torchrun)**: every parameter is a DTensor shard. Each is gathered with
  ``full_tensor()``, a collective, so *every rank* calls :func:`rollout_state_dict` at the
  same point, in the same order; only rank 0 keeps the full tensors (the others get
  ``None``), one tensor at a time, so no rank ever holds more than one extra full tensor.
- **LoRA**: the adapter is folded in on the side (:func:`portarl.lora.merged_state_dict`,
  ``W + scaling * B @ A`` summed in fp32), under the base model's names; the training
  model is never merged in place.
- **Tied weights** (the output head sharing the embedding): written once, under the first
  name (``load_model`` fills the tied twin); a gathered or merged state dict no longer
  shares the storage ``safetensors.torch.save_model`` would detect.

Floating-point tensors are written in the rollout's dtype (``precision.dtype``): FSDP2 keeps
fp32 parameters under a bf16 / fp16 compute policy and casts them for every forward; the
cast here rounds the same way (round to nearest even), so the worker samples the weights
the trainer's own forward would use. On one process the model already has that dtype and
the tensors are written unchanged (bitwise: the staleness-0 equivalence depends on it).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from portarl.lora import base_model, is_lora, merged_state_dict


def tied_twins(model: torch.nn.Module) -> set[str]:
    """Names (base-model names) of parameters that are the same tensor as an earlier one."""
    inner = base_model(model)
    seen: dict[int, str] = {}
    twins = set()
    for name, param in inner.named_parameters(remove_duplicate=False):
        name = ".".join(p for p in name.split(".") if p != "base_layer")
        if id(param) in seen:
            twins.add(name)
        else:
            seen[id(param)] = name
    return twins


def rollout_state_dict(model: torch.nn.Module, dtype: torch.dtype, is_main: bool = True) -> dict | None:
    """``{name: tensor}`` (contiguous, on the CPU) for the worker's plain model, on the rank
    with ``is_main``; ``None`` elsewhere. Collective under FSDP2: every rank must call it."""
    twins = tied_twins(model)
    state = merged_state_dict(model) if is_lora(model) else model.state_dict()
    out = {} if is_main else None
    for name, tensor in state.items():
        if name in twins:
            continue
        t = tensor.detach()
        if hasattr(t, "full_tensor"):  # an FSDP2 shard: gather (every rank takes part)
            t = t.full_tensor()
        if out is None:
            continue
        if t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        out[name] = t.cpu().contiguous()
    return out


def write_rollout_weights(model: torch.nn.Module, dtype: torch.dtype, path: Path, is_main: bool = True) -> bool:
    """Write :func:`rollout_state_dict` to ``path`` atomically (temporary name, then rename)
    on the main rank; returns whether this rank wrote. Collective under FSDP2."""
    from safetensors.torch import save_file

    state = rollout_state_dict(model, dtype, is_main)
    if state is None:
        return False
    tmp = Path(path).with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return True


__all__ = ["rollout_state_dict", "tied_twins", "write_rollout_weights"]
