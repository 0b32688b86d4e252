"""Routing replay for mixture-of-experts models (R3, ``rollout.routing_replay: rollout``;
R2, ``old``, records in the trainer: :mod:`portarl.moe.old_routing`).

Why: in an MoE layer each token goes to the top-k experts of a router. The rollout
engine and the trainer compute the router's logits in different kernels, batch shapes
or precisions; where two experts are nearly tied they pick differently, and then the
"same" policy gives the token a different log-prob. That, not the kernels, is most of
an MoE model's train-inference mismatch, and importance-sampling correction only works
against the symptom. Routing replay removes the cause: the engine records the experts it
chose for every token it fed, and the trainer's forward uses those experts, with the
gate weights recomputed by the current router on them (softmax over all experts,
gathered on the recorded ones, renormalised where the model does), so the router still
learns. verl ``router_replay.mode: R3``, slime ``--use-rollout-routing-replay``.

How: each router (transformers' ``*TopKRouter``: Qwen3-MoE, Qwen2-MoE, returning
``(logits, scores, indices)``) gets a forward that reads a per-router state:

- recording (:func:`recording`): the indices it chose are appended, one tensor per call;
- replaying (:func:`set_replay`): for the forward's flattened tokens, the recorded
  indices where known, its own top-k elsewhere (padding, a completion's last token, which
  the engine never fed); the fraction of known tokens whose recorded experts are the ones
  it would have chosen itself is counted (``rollout/routing_agreement``).

The replay state stays set until the next forward sets another (or clears it), so
activation checkpointing's recomputation in the backward routes as the forward did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import torch
import torch.nn.functional as F


def routers(model) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")
            and hasattr(m, "top_k") and hasattr(m, "weight")]


def is_moe(model) -> bool:
    return bool(routers(model))


@dataclasses.dataclass
class _State:
    record: list | None = None       # recording: one [N, k] tensor per call
    given: torch.Tensor | None = None  # replaying: [N, k] experts for this forward's tokens
    known: torch.Tensor | None = None  # [N] bool: which tokens have recorded experts
    agree: int = 0                   # known tokens routed as the router would itself
    counted: int = 0                 # known tokens seen


def choose(probs: torch.Tensor, k: int) -> torch.Tensor:
    """The router's own choice: the indices of the ``k`` largest probabilities ([N, k]).
    (One function, so a test can make a rollout engine choose otherwise, as an engine whose
    router kernel rounds differently does on near-ties.)"""
    return torch.topk(probs, k, dim=-1).indices


def _route(router, hidden: torch.Tensor):
    """The router's own computation (transformers' TopKRouter), with a recorded choice of
    experts where one is set."""
    state: _State = router._portarl_routing
    hidden = hidden.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden, router.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    chosen = choose(probs, router.top_k)
    if state.given is not None and state.given.shape[0] == chosen.shape[0]:
        known = state.known
        same = (chosen.sort(-1).values == state.given.sort(-1).values).all(-1) & known
        state.agree += int(same.sum())
        state.counted += int(known.sum())
        chosen = torch.where(known[:, None], state.given, chosen)
    top = probs.gather(-1, chosen)  # the top-k values where chosen is the top-k (the same numbers)
    if getattr(router, "norm_topk_prob", False):
        top = top / top.sum(dim=-1, keepdim=True)
    if state.record is not None:
        state.record.append(chosen.detach().to(torch.int16))
    return logits, top.to(logits.dtype), chosen


def install(model) -> int:
    """Give every router of ``model`` the replayable forward (once); returns the router count."""
    found = routers(model)
    for router in found:
        if not hasattr(router, "_portarl_routing"):
            router._portarl_routing = _State()
            # A bound method, not a closure: a deep copy of the model (the KL reference) then
            # routes with its own router's weights and state (copy rebinds methods).
            router.forward = types.MethodType(_route, router)
    if found:
        model._portarl_replays = True  # the trainer's forwards clear a replay their batch does not carry
    return len(found)


@contextlib.contextmanager
def recording(model):
    """Record the experts every router of ``model`` chooses, per call: yields the list of
    per-router lists of [N, k] int16 tensors. Replay is off meanwhile."""
    found = routers(model)
    install(model)
    calls = [[] for _ in found]
    for router, out in zip(found, calls):
        state = router._portarl_routing
        state.record, state.given, state.known = out, None, None
    try:
        yield calls
    finally:
        for router in found:
            router._portarl_routing.record = None


def set_replay(model, experts: torch.Tensor | None, known: torch.Tensor | None = None) -> None:
    """Route the next forwards of ``model`` by ``experts`` [layers, tokens, k] where ``known``
    [tokens] is true (the forward's tokens flattened in order); None: the routers' own choice."""
    found = routers(model)
    if not found:
        return
    install(model)
    if experts is not None and experts.shape[0] != len(found):
        raise ValueError(f"routing replay: experts for {experts.shape[0]} MoE layers, the model has {len(found)}")
    for layer, router in enumerate(found):
        state = router._portarl_routing
        state.given = None if experts is None else experts[layer].long()
        state.known = None if experts is None else known


def take_agreement(model) -> tuple[int, int]:
    """``(agreeing, counted)`` known tokens over every router since the last call; resets."""
    agree = counted = 0
    for router in routers(model):
        state = getattr(router, "_portarl_routing", None)
        if state is not None:
            agree, counted = agree + state.agree, counted + state.counted
            state.agree = state.counted = 0
    return agree, counted


@dataclasses.dataclass
class RoutingRows:
    """Recorded experts of a padded batch: ``experts`` [layers, B, S, k] (long) and
    ``known`` [B, S] bool, in the batch's columns."""

    experts: torch.Tensor
    known: torch.Tensor

    def rows(self, index) -> "RoutingRows":
        return RoutingRows(self.experts[:, index], self.known[index])

    def columns(self, start: int, end: int) -> "RoutingRows":
        return RoutingRows(self.experts[:, :, start:end], self.known[:, start:end])

    def prompt_keys(self, prompt_width: int, prompt_lens: list[int]) -> list[bytes]:
        """Per row, its prompt tokens' recorded experts as bytes: shared-prompt packing
        shares a prompt only between rows the engine routed alike (an engine may route the
        G copies of a prompt differently: its batch shapes, or noise on near-ties)."""
        out = []
        for i, p in enumerate(prompt_lens):
            out.append(self.experts[:, i, prompt_width - p : prompt_width].to(torch.int16).cpu().numpy().tobytes())
        return out

    def flat(self, packed=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(experts [layers, tokens, k], known [tokens])`` in the forward's token order:
        padded row-major, or gathered by ``packed.source`` (a padding-free layout)."""
        layers, k = self.experts.shape[0], self.experts.shape[-1]
        experts, known = self.experts.reshape(layers, -1, k), self.known.reshape(-1)
        if packed is None:
            return experts, known
        # A packed row's unused tail gathers position 0 (``source`` 0): never a recorded token.
        return experts.index_select(1, packed.source), known.index_select(0, packed.source) & packed.real()


def routing_rows(recorded: list, prompt_lens: list[int], completion_lens: list[int], width_p: int, width_c: int,
                 device) -> RoutingRows:
    """:class:`RoutingRows` of a padded batch from each sample's recorded experts
    ([layers, fed tokens, k]: its prompt, then its completion but the last token)."""
    first = next(r for r in recorded if r is not None)
    layers, k = first.shape[0], first.shape[-1]
    experts = torch.zeros(layers, len(recorded), width_p + width_c, k, dtype=torch.long)
    known = torch.zeros(len(recorded), width_p + width_c, dtype=torch.bool)
    for i, (r, p, c) in enumerate(zip(recorded, prompt_lens, completion_lens)):
        if r is None:
            continue
        n = min(r.shape[1], p + max(c - 1, 0))
        experts[:, i, width_p - p : width_p - p + n] = r[:, :n].long()
        known[i, width_p - p : width_p - p + n] = True
    return RoutingRows(experts.to(device), known.to(device))


def experts_json(recorded: list) -> list[dict]:
    """Recorded experts (per sample [layers, tokens, k] int16) as JSON values: shape and
    base64 bytes (2 bytes per token, layer and k), for the asynchronous worker's replies
    and the checkpoints of batches in flight."""
    import base64

    return [{"shape": list(r.shape), "int16": base64.b64encode(r.to(torch.int16).contiguous().numpy().tobytes()).decode()}
            for r in recorded]


def experts_from_json(values: list) -> list[torch.Tensor]:
    """:func:`experts_json`'s output back as int16 tensors; a malformed entry raises ValueError."""
    import base64

    import numpy as np

    out = []
    for i, v in enumerate(values):
        try:
            shape = [int(n) for n in v["shape"]]
            data = np.frombuffer(base64.b64decode(v["int16"], validate=True), dtype=np.int16)
            out.append(torch.from_numpy(data.copy()).view(*shape))
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"routed experts of sample {i} are malformed ({type(err).__name__}: {err})") from None
    return out
