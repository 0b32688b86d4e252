"""Expert load and the router load-balancing loss of a mixture-of-experts model's training
forwards (``moe/load_imbalance``, ``loss.router_aux_coef`` / ``moe/aux_loss``).

Why hooks: the trainer runs the decoder (``model.get_decoder()``, or the FSDP2 model with
its head passed through), never the CausalLM forward that would return
``router_logits`` and transformers' aux loss, and its forwards may be packed (no padded
``attention_mask`` to mask the padding by). A forward hook on each router
(:func:`portarl.moe.routing.routers`) takes, per training forward, the router's logits and
the experts the forward used (replayed ones under routing replay), in the forward's
flattened token order; :func:`real_tokens` says which of those tokens are real.

- Load: per MoE layer, the tokens each expert got over the optimizer step's real tokens
  (one scatter-add per router per micro-batch, on the device: no host sync). Imbalance
  of a layer = its busiest expert's share / the mean share (1: balanced; E / k at most:
  every token to the same k experts); the metric is the worst layer's.
- Aux loss (only with ``router_aux_coef > 0``, so 0 leaves the step bit-identical): the
  model family's ``load_balancing_loss_func`` on the captured logits, masked to the real
  tokens, as transformers' CausalLM forward computes it with ``output_router_logits``.

The hooks collect only inside :meth:`RouterTap.forward`: activation checkpointing's
recomputation in the backward runs the routers again and must not count twice.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from portarl.moe.routing import routers


def real_tokens(batch) -> torch.Tensor:
    """bool [tokens]: the forward's flattened tokens (padded row-major, or packed) that are
    prompt or completion tokens of a sequence, not padding or a packed row's tail."""
    if batch.packed is not None:
        return batch.packed.real()
    return batch.attention_mask.reshape(-1).bool()


def _balancing_loss(model):
    """The model family's ``load_balancing_loss_func`` (Qwen3-MoE's when its module has none)."""
    from portarl.assets.lora import base_model

    inner = base_model(model)
    try:
        module = importlib.import_module(type(inner).__module__)
        func = getattr(module, "load_balancing_loss_func", None)
    except ImportError:  # pragma: no cover
        func = None
    if func is None:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func as func
    return func


class RouterTap:
    """Forward hooks on ``model``'s routers (open / close, or a context manager); counts
    per optimizer step (:meth:`reset`)."""

    def __init__(self, model, *, aux: bool = False):
        self.routers = routers(model)
        self.loss_func = _balancing_loss(model)
        self.aux = aux
        self.handles: list = []
        self.on = False
        self.logits: list = [None] * len(self.routers)
        self.chosen: list = [None] * len(self.routers)
        self.counts: torch.Tensor | None = None  # [layers, E] tokens per expert, this step

    def open(self) -> "RouterTap":
        for layer, router in enumerate(self.routers):
            self.handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def reset(self, *, aux: bool) -> None:
        """A new optimizer step: counts from zero; ``aux``: keep the logits for the aux loss."""
        self.aux, self.counts = aux, None

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()
        return False

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self.on:
                logits, _, chosen = output
                self.logits[layer] = logits if self.aux else None
                self.chosen[layer] = chosen.detach()
        return hook

    @contextlib.contextmanager
    def forward(self):
        """Collect the routers' outputs of the forward run inside (one micro-batch's)."""
        self.logits = [None] * len(self.routers)
        self.chosen = [None] * len(self.routers)
        self.on = True
        try:
            yield self
        finally:
            self.on = False

    def count(self, real: torch.Tensor) -> None:
        """Add the last forward's real tokens to each layer's expert counts."""
        if not self.routers or any(c is None for c in self.chosen):
            return
        experts = self.routers[0].num_experts
        if self.counts is None:
            self.counts = torch.zeros(len(self.routers), experts, dtype=torch.float32, device=real.device)
        for layer, chosen in enumerate(self.chosen):
            weight = real.to(torch.float32)[:, None].expand(chosen.shape).reshape(-1)
            self.counts[layer].index_add_(0, chosen.reshape(-1).to(real.device), weight)

    def aux_loss(self, real: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss of the last forward, over its real tokens."""
        router = self.routers[0]
        return self.loss_func(tuple(self.logits), router.num_experts, router.top_k, real)

    def imbalance(self, counts: torch.Tensor | None = None) -> torch.Tensor:
        """The worst layer's busiest-expert share / mean share (a 0-d device tensor)."""
        counts = self.counts if counts is None else counts
        mean = counts.mean(-1).clamp(min=1e-12)
        return (counts.max(-1).values / mean).max()


def router_aux_refusal(config, model) -> str | None:
    """Why ``loss.router_aux_coef`` cannot apply to ``model`` (one line), or None."""
    if config.loss.router_aux_coef > 0 and not routers(model):
        return (f"loss.router_aux_coef={config.loss.router_aux_coef:g} needs a mixture-of-experts model (model.path "
                f"{config.model.path!r} has no routers); set loss.router_aux_coef=0")
    return None


__all__ = ["RouterTap", "real_tokens", "router_aux_refusal"]
