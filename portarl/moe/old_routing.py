"""Routing replay R2 (``rollout.routing_replay: old``): the update's forwards route by the
experts the *old policy* chose in the trainer.

Why: with several optimizer steps per rollout (``train.ppo_epochs`` x
``train.mini_batches`` > 1) the policy moves between the update's mini-batches, and an MoE
policy moves its routers too. A token whose experts change between the old log-prob
forward and the update's forward then has a ratio that mixes two things: the new
weights of the same experts (what the clipped objective is about) and a switch of
experts (a discontinuous jump the trust region was not built for). R2 keeps the routing
of the old forward fixed through the update, so the ratio only measures the weights'
change; the gate values are still recomputed by the current router on those experts,
so the router still learns (verl ``router_replay.mode: R2``, slime ``--use-routing-replay``).
Unlike R3 (``rollout``), nothing comes from the rollout engine: the recording is the
trainer's own.

When (:func:`portarl.trainer.phases.scoring.score`):

- old log-probs recomputed (their own no-grad forward: several optimizer steps, a KL
  penalty in the reward, the NPU emulation, an engine that did not sample the current
  weights, ``train.old_logprobs: recompute``): that forward records each token's top-k
  experts per MoE layer (:func:`portarl.moe.routing.recording`), put back in the batch's
  padded grid here (:func:`place`) whatever the micro-batch layout was; every later
  forward of the batch (each mini-batch's micro-batches, every PPO epoch) replays them;
- old log-probs taken from the training forward (one optimizer step per batch, colocated
  or async: the on-policy shortcut): that forward *is* the old policy's first forward of
  the batch and no later forward of the batch exists, so it routes by its own router and
  there is nothing to replay (``rollout/routing_agreement`` is 1 by definition).

The KL reference routes by its own router (the policy's old routing says nothing about a
different set of weights); only the update replays.

Which tokens are recorded: as in R3, each sequence's prompt and its completion but the
last token (whose output scores nothing); padding, a packed row's unused tail and the
last completion token route by the forward's own choice.
"""

from __future__ import annotations

import torch

from portarl.moe.routing import RoutingRows


def empty_rows(layers: int, rows: int, width: int, k: int, device) -> RoutingRows:
    """A batch's :class:`RoutingRows` with nothing recorded yet (every ``known`` false)."""
    return RoutingRows(torch.zeros(layers, rows, width, k, dtype=torch.long, device=device),
                       torch.zeros(rows, width, dtype=torch.bool, device=device))


def fed_tokens(attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """bool [B, S]: the prompt tokens and the completion tokens but the last of each row
    (the tokens whose experts a replay uses; R3's engine records the same ones)."""
    attn = attention_mask.bool()
    after = torch.cat([attn[:, 1:], torch.zeros_like(attn[:, :1])], dim=1)  # a token follows
    cols = torch.arange(attn.shape[1], device=attn.device)[None, :]
    return attn & ((cols < prompt_width) | after)


def _copy_shared_prompts(part, experts: torch.Tensor, got: torch.Tensor, fed: torch.Tensor) -> None:
    """Shared-prompt rows: a group's prompt was computed once, in its first row; the other
    rows with the same prompt tokens (equal tokens: equal hidden states, equal routing) take
    its experts. In place."""
    width = part.prompt_width
    missing = (fed[:, :width] & ~got[:, :width]).any(-1)
    if not bool(missing.any()):
        return
    lens = part.attention_mask[:, :width].sum(-1).tolist()
    ids = part.input_ids[:, :width].tolist()
    keys = [tuple(row[width - p:]) for row, p in zip(ids, lens)]
    donors: dict = {}
    for i, lacking in enumerate(missing.tolist()):
        if not lacking:
            donors.setdefault(keys[i], i)
    for i, lacking in enumerate(missing.tolist()):
        j = donors.get(keys[i]) if lacking else None
        if j is not None:
            experts[:, i, :width] = experts[:, j, :width]
            got[i, :width] = got[j, :width]


def part_routing(chosen: torch.Tensor, part) -> RoutingRows:
    """The experts one forward of micro-batch ``part`` chose, ``chosen`` [layers, N, k] in
    the forward's flattened token order (padded row-major, or packed:
    ``part.packed.source`` says where each packed token sits in the padded rows), as
    :class:`RoutingRows` of the micro-batch's padded grid; ``known`` marks the fed tokens
    the forward computed (:func:`fed_tokens`)."""
    layers, k = chosen.shape[0], chosen.shape[-1]
    rows, width = part.input_ids.shape
    device = part.input_ids.device
    chosen = chosen.to(device=device, dtype=torch.long)
    if part.packed is None:
        experts = chosen.reshape(layers, rows, width, k).clone()
        got = torch.ones(rows, width, dtype=torch.bool, device=device)
    else:
        real = part.packed.real()
        source = part.packed.source[real]
        experts = torch.zeros(layers, rows * width, k, dtype=torch.long, device=device)
        experts[:, source] = chosen[:, real]
        got = torch.zeros(rows * width, dtype=torch.bool, device=device)
        got[source] = True
        experts, got = experts.view(layers, rows, width, k), got.view(rows, width)
    fed = fed_tokens(part.attention_mask, part.prompt_width)
    if part.packed is not None:
        _copy_shared_prompts(part, experts, got, fed)
    return RoutingRows(experts, fed & got)


def place(into: RoutingRows, rows, part, routing: RoutingRows, prompt_width: int) -> None:
    """Write micro-batch ``part``'s recorded ``routing`` into the batch's ``into`` at its
    ``rows`` (a slice or an index tensor) and columns (a micro-batch keeps the last
    ``part.prompt_width`` prompt columns of the batch's ``prompt_width``)."""
    start = prompt_width - part.prompt_width
    end = start + part.input_ids.shape[1]
    into.experts[:, rows, start:end] = routing.experts
    into.known[rows, start:end] = routing.known


__all__ = ["empty_rows", "fed_tokens", "part_routing", "place"]
