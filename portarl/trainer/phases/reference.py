"""The KL reference policy, as a context: a frozen copy of the initial model, or with LoRA
the training model itself with its adapter disabled; and its optional sync toward the
policy (TRL's ``sync_ref_model``, :func:`maybe_sync_reference`).

Why a context and not a model: with LoRA the reference *is* the base model, which the
training model already holds; ``peft``'s ``disable_adapter()`` switches the adapter off
for the duration, so no second copy of the weights is made (the point of LoRA on a large
model). Leaving the context switches it back on, also after an error.
"""

from __future__ import annotations

import contextlib

import torch

from portarl.assets.lora import is_lora


@contextlib.contextmanager
def reference_model(trainer):
    """Yield the module whose log-probs are the reference's (``ref_logp``)."""
    if is_lora(trainer.model):
        with trainer.model.disable_adapter():
            yield trainer.model
        return
    if trainer.ref_model is None:
        trainer.ref_model = trainer.make_reference()
    yield trainer.ref_model


def refuse_reference_sync(config, model, distributed: bool) -> str | None:
    """Why ``reference.sync`` cannot run with this model / launch, or None."""
    if not config.reference.sync:
        return None
    if config.model.lora is not None or is_lora(model):
        from portarl.trainer.config.algorithms import REFERENCE_SYNC_LORA

        return REFERENCE_SYNC_LORA
    if distributed:
        return ("reference.sync under torchrun: the synced reference is not in the sharded checkpoint, so a "
                "resumed run would silently anchor to the initial model; run it in one process or set "
                "reference.sync=false")
    return None


@torch.no_grad()
def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """``ref <- alpha * policy + (1 - alpha) * ref``, parameter by parameter, in the
    reference's dtype (TR-DPO, arXiv 2404.09656; TRL's SyncRefModelCallback). Buffers are
    not mixed (TRL mixes parameters only)."""
    ref_params = dict(reference.named_parameters())
    for name, p in policy.named_parameters():
        target = ref_params[name]
        target.mul_(1.0 - alpha).add_(p.detach().to(target.dtype), alpha=alpha)


def maybe_sync_reference(trainer, step: int, metrics: dict) -> None:
    """After iteration ``step``: every ``reference.sync_steps`` iterations, mix the policy
    into the reference (``reference.mixup_alpha``); ``reference/synced`` says when."""
    r = trainer.config.reference
    if not r.sync or trainer.ref_model is None:
        return
    synced = step % r.sync_steps == 0
    if synced:
        mix_into_reference(trainer.ref_model, trainer.model, r.mixup_alpha)
    metrics["reference/synced"] = float(synced)
