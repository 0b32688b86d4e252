"""Sequence-parallel (Ulysses) groups and their collectives (``train.sequence_parallel_size``).

With SP ranks per group, a torchrun job of W ranks is W / SP data-parallel groups of SP
consecutive ranks each (ranks ``[d * SP, (d + 1) * SP)`` form data-parallel group ``d``).
Every rank of a group holds the same rows; each row is cut along the sequence into SP
contiguous shards, one per rank, and around attention an all-to-all turns
[shard tokens, all heads] into [all tokens, heads / SP] and back (DeepSpeed-Ulysses;
:mod:`portarl.trainer.phases.ulysses`).

The collectives here are autograd functions:

- :func:`all_to_all`: scatter one dimension, gather another; its backward is the reverse
  all-to-all (the exact adjoint of the forward's permutation of data).
- :func:`sum_over_group`: the sum over the group of tensors in which each rank fills its
  own entries (the log-probs of the tokens its shard scores) and zeros elsewhere. Its
  backward passes the gradient through, not summed over ranks: every rank of the group
  computes the same loss from the same summed values, so the group's combined backward
  seeds each entry's gradient exactly once (on the rank that computed it), and the sum of
  the group's parameter gradients is the gradient of that loss.

Device tensors go over the group's device backend (NCCL / HCCL; Gloo on the CPU), the
rollout broadcast (:func:`broadcast_rows`) over its Gloo side.
"""

from __future__ import annotations

import dataclasses
import json

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class SPGroup:
    """This rank's sequence-parallel group."""

    size: int
    #: This rank's index in its group (which shard of every row it holds).
    rank: int
    #: The group's global ranks, ascending.
    ranks: tuple
    #: The data-parallel group index (which rows) and how many there are.
    dp_rank: int
    dp_size: int
    group: object = dataclasses.field(default=None, compare=False, repr=False)
    #: The group for CPU tensors (the same group when it has Gloo beside the device backend).
    host_group: object = dataclasses.field(default=None, compare=False, repr=False)


def make_group(ctx, size: int) -> SPGroup | None:
    """The SP group of this rank (every rank makes every group, in order, as
    ``dist.new_group`` requires); None for ``size`` 1. ``ctx``: the job's
    :class:`portarl.runtime.distributed.DistContext`; ``size`` must divide its world size
    (checked at start: :func:`portarl.trainer.phases.ulysses.sequence_parallel_refusal`)."""
    if size == 1:
        return None
    world, rank = ctx.world_size, ctx.rank
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        host = dist.new_group(ranks, backend="gloo") if ctx.host_group is not None else group
        if rank in ranks:
            mine = (tuple(ranks), group, host)
    ranks, group, host = mine
    return SPGroup(size, rank - ranks[0], ranks, rank // size, world // size, group, host)


def _all_to_all(x: torch.Tensor, sp: SPGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    parts = torch.stack([p.contiguous() for p in x.chunk(sp.size, dim=scatter_dim)])  # [SP, ...]: part j to rank j
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts, group=sp.group)  # out[j]: rank j's part for this rank
    return torch.cat(out.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp, scatter_dim, gather_dim):
        ctx.sp, ctx.dims = sp, (scatter_dim, gather_dim)
        return _all_to_all(x, sp, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.sp, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, sp: SPGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """``x`` cut into SP parts along ``scatter_dim`` (part j to rank j), the parts received
    concatenated along ``gather_dim`` in rank order; differentiable. ``x.shape[scatter_dim]``
    must be a multiple of SP."""
    if x.shape[scatter_dim] % sp.size:
        raise ValueError(f"all_to_all: dimension {scatter_dim} of {tuple(x.shape)} is not a multiple of the "
                         f"{sp.size} sequence-parallel ranks")
    return _AllToAll.apply(x, sp, scatter_dim, gather_dim)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp):
        out = x.clone()
        dist.all_reduce(out, group=sp.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_group(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """``x`` summed over the group's ranks; differentiable, the backward passing the
    incoming gradient through unchanged (module docstring: the loss computed from the result
    must be the same on every rank of the group, and each rank fills its own entries of
    ``x``, zeros elsewhere)."""
    return _SumOverGroup.apply(x, sp)


def broadcast_rows(sp: SPGroup, value):
    """The group's first rank's JSON-able ``value`` on every rank of the group (as UTF-8
    JSON bytes over the group's Gloo side; nothing unpickled, floats exact)."""
    first = sp.rank == 0
    data = json.dumps(value).encode() if first else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, group=sp.host_group, group_src=0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if first else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, group=sp.host_group, group_src=0)
    return value if first else json.loads(bytes(buf.numpy()).decode())


__all__ = ["SPGroup", "all_to_all", "broadcast_rows", "make_group", "sum_over_group"]
