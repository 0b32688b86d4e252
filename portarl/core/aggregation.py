"""One aggregation of per-token values into a scalar, used for every loss term.

The policy-gradient, KL and entropy terms all go through :func:`aggregate_loss` with the
same mode and normalisers, so they live on the same scale (the common failure is a PG term
normalised over all tokens next to a KL term normalised per sequence).

Micro-batching and data-parallel sharding: pass the *global* normalisers
(``num_global_tokens`` / ``num_global_seqs``: counts over the whole optimizer batch, all
ranks) and each shard's result is its share of the batch loss: summing shards gives exactly
the full-batch loss and gradient. Without them the local counts are used (one batch).

Fully masked sequences (empty completions) are left out of every count, never NaN; a
batch with no valid token gives 0 (with a graph, so backward still runs).
"""

from __future__ import annotations

import torch

from portarl.core._checks import check_mask, check_positive, check_tokens
from portarl.ops import _checks as op_checks

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def token_count(mask: torch.Tensor) -> int:
    """Valid tokens: the ``num_global_tokens`` contribution of one shard."""
    return int(check_mask(mask, mask).sum())


def sequence_count(mask: torch.Tensor) -> int:
    """Sequences with at least one valid token: the ``num_global_seqs`` contribution of one shard."""
    return int(check_mask(mask, mask).any(dim=-1).sum())


def _normaliser(name: str, given, local: torch.Tensor):
    """The divisor: ``local`` (a tensor) when no global count is given, else the given count
    as a Python number (no tensor built from it, no host sync). That the given count is not
    below the local one is checked eagerly on CPU, as a device-side assert on accelerators
    (``PORTARL_DEBUG_CHECKS=1``: eagerly there too; :func:`portarl.ops._checks.eager_checks`)."""
    if given is None:
        return local.clamp(min=1).to(torch.float32)
    if isinstance(given, torch.Tensor):
        given = given.item()
    if isinstance(given, bool) or not isinstance(given, (int, float)) or given < 0:
        raise ValueError(f"{name} must be a count >= 0 over the whole batch, got {given!r}")
    if not op_checks.eager_checks(local.device):
        torch._assert_async(local <= given, f"{name}={given} is smaller than this shard's own count: pass the count "
                            f"over the whole optimizer batch (all micro-batches and ranks)")
    elif given < float(local):
        raise ValueError(
            f"{name}={given} is smaller than this shard's own count {int(local)}: pass the count over "
            "the whole optimizer batch (all micro-batches and ranks)"
        )
    return max(float(given), 1.0)


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_global_tokens: int | None = None,
    num_global_seqs: int | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """Scalar from per-token ``values`` [B, T] over the bool ``mask`` [B, T].

    Modes (|o_i| = valid tokens of sequence i, S = sequences with |o_i| > 0):
        ``token-mean``: sum of all valid values / total valid tokens (DAPO).
        ``seq-mean-token-mean``: mean over S of (sum_t v / |o_i|) (GRPO).
        ``seq-mean-token-sum``: mean over S of sum_t v.
        ``seq-mean-token-sum-norm``: sum of all valid values / (|S| * max_response_length)
            (Dr. GRPO: a constant per-sequence normaliser, no length bias).

    Returns fp32. Values at masked positions are ignored even if NaN or inf.
    """
    check_tokens("values", values)
    mask = check_mask(mask, values)
    v = torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32))
    lengths = mask.sum(dim=-1)
    if mode == "token-mean":
        return v.sum() / _normaliser("num_global_tokens", num_global_tokens, lengths.sum())
    seqs = _normaliser("num_global_seqs", num_global_seqs, (lengths > 0).sum())
    if mode == "seq-mean-token-mean":
        per_seq = v.sum(dim=-1) / lengths.clamp(min=1)
        return per_seq.sum() / seqs
    if mode == "seq-mean-token-sum":
        return v.sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        if max_response_length is None:
            raise ValueError("seq-mean-token-sum-norm needs max_response_length (the constant Dr. GRPO normaliser)")
        length = check_positive("max_response_length", max_response_length)
        return v.sum() / (seqs * length)
    raise ValueError(f"loss aggregation mode {mode!r} is not one of {', '.join(AGG_MODES)}")
