"""Reward models in the memory plan: each one's parameters at its dtype, on the device it
runs on (:mod:`portarl.assets.reward_models`), counted from its ``config.json`` alone (the
model is built on the meta device: nothing is read or allocated).

A reward model without ``device`` runs on the scoring process's device (each rank's, or the
async worker's) and is added to what that device holds for the whole run ("reward model
<name>"); one with a ``device`` of its own is reported in a note instead, since the plan is
per trainer device. No activations are counted: its forwards run under inference mode, one
``batch_size`` at a time, in the scoring phase, where the update's buffers are free.
"""

from __future__ import annotations

import torch

from portarl.trainer.memory.engine import gib


def parameter_count(path: str, where: str = "rewards[]") -> int:
    """The reward model's parameters, from its config (meta device)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from portarl.assets.reward_models import read_model_config

    read_model_config(path, where)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    return sum(p.numel() for p in model.parameters())


def reward_model_memory(cfg) -> tuple[dict[str, int], list[str]]:
    """``(parts, notes)``: bytes held on the trainer's device by name, and a line for each
    reward model on a device of its own."""
    from portarl.assets.reward_models import model_dtype_name

    parts, notes = {}, []
    for i, spec in enumerate(cfg.rewards):
        if spec.kind != "model":
            continue
        dtype = model_dtype_name(spec.dtype, cfg.precision.dtype)
        size = parameter_count(spec.model, f"rewards[{i}]") * (2 if dtype == "bf16" else 4)
        if spec.device is None:
            parts[f"reward model {spec.name}"] = size
        else:
            notes.append(f"reward model {spec.name}: {gib(size)} ({dtype}) on {spec.device}, not on the trainer's "
                         "device")
    return parts, notes
