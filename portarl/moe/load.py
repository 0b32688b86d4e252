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
  Switch Transformer loss ``E * sum_i f_i * P_i`` of transformers' ``load_balancing_loss_func``
  (the Qwen3-MoE / Qwen2-MoE / Mixtral one), on the captured logits of the real tokens:
  ``f_i`` the share of top-k assignments (of every MoE layer) that went to expert i, ``P_i``
  the mean router probability of expert i. Under torchrun a rank sees only its share of a
  micro-batch, and the loss is a product of two means, so the mean of the ranks' losses is
  not the loss of their tokens together. The statistics (:meth:`RouterTap.aux_statistics`:
  assignment counts, probability sums, token count) are summed over ranks instead, and each
  rank's term is ``E * sum_i f_i * (its probability sum_i / all tokens)``: the ranks' terms
  add up to the loss of the ranks' micro-batches together, value and gradient, which is
  what one process holding those rows in one micro-batch computes (on one process it is
  transformers' function, bitwise). As in transformers, ``f_i`` counts each token's own
  top-k (with routing replay the experts used may differ; ``f`` carries no gradient).

The hooks collect only inside :meth:`RouterTap.forward`: activation checkpointing's
recomputation in the backward runs the routers again and must not count twice.
"""

from __future__ import annotations

import contextlib

import torch

from portarl.moe.routing import routers


def real_tokens(batch) -> torch.Tensor:
    """bool [tokens]: the forward's flattened tokens (padded row-major, or packed) that are
    prompt or completion tokens of a sequence, not padding or a packed row's tail."""
    if batch.packed is not None:
        return batch.packed.real()
    return batch.attention_mask.reshape(-1).bool()


class RouterTap:
    """Forward hooks on ``model``'s routers (open / close, or a context manager); counts
    per optimizer step (:meth:`reset`)."""

    def __init__(self, model, *, aux: bool = False):
        self.routers = routers(model)
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

    def aux_statistics(self, real: torch.Tensor) -> torch.Tensor:
        """The last forward's load-balancing statistics over its real tokens, as one vector
        ``[counts (E), probs (E), rows]`` to be summed over ranks: top-k assignments per
        expert and router probabilities per expert, each summed over the MoE layers, and
        layers x real tokens. The probabilities keep their gradient (sum them over ranks
        detached). Accumulated layer by layer in the order transformers'
        ``load_balancing_loss_func`` does, so one process's loss is its number bitwise."""
        router = self.routers[0]
        experts, k = router.num_experts, router.top_k
        device = self.logits[0].device
        counts = torch.zeros(experts, dtype=torch.float32, device=device)
        probs = torch.zeros(experts, dtype=torch.float32, device=device)
        rows = torch.zeros((), dtype=torch.float32, device=device)
        mask = real.reshape(-1).to(device=device, dtype=torch.float32)
        for logits in self.logits:
            weights = torch.softmax(logits, dim=-1)
            _, selected = torch.topk(weights, k, dim=-1)
            counts = counts + torch.zeros(experts, dtype=torch.float32, device=device).scatter_add_(
                0, selected.reshape(-1), mask.repeat_interleave(k))
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
        return torch.cat([counts, probs, rows.reshape(1)])

    def aux_from(self, local: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(term, value)`` from this rank's :meth:`aux_statistics` ``local`` and their sum
        over ranks ``total``: ``term`` (with gradient) is this rank's share of the loss of
        every rank's tokens together (the ranks' terms add up to it), ``value`` that loss."""
        experts = self.routers[0].num_experts
        counts, probs, rows = total[:experts], total[experts:2 * experts], total[2 * experts]
        f = counts / rows
        value = torch.sum(f * (probs / rows).unsqueeze(0)) * experts
        term = torch.sum(f * (local[experts:2 * experts] / rows).unsqueeze(0)) * experts
        return term, value.detach()

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
