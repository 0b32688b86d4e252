"""Entropy masking: policy gradient only on the high-entropy minority of tokens (Wang et al.
2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL for LLM
Reasoning", arXiv 2506.01939; TRL's ``top_entropy_quantile``).

Contract: ``entropy`` [B, T] (any float dtype; read in fp32, no gradient taken) and a bool
``mask``; returns a bool [B, T] ``keep`` that is True exactly on the valid tokens whose
entropy is >= the (1 - q) quantile of the valid tokens' entropies, the quantile linearly
interpolated as ``torch.quantile`` does (TRL's rule). Kept count k satisfies
q n - q <= k <= q n + 1 - q for n valid tokens of distinct entropies (within one token of
q n); ties at the threshold are all kept. No host sync (no boolean indexing): the quantile is
a sort and a gather. An empty mask keeps nothing. A NaN entropy is never kept (every
comparison with it is false); non-finite entropies come from non-finite logits, whose tokens
the loss's guard has already left out (``drop_nonfinite_tokens``).
"""

from __future__ import annotations

import torch


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Valid tokens in the top ``quantile`` (0 < q <= 1) by entropy (see the module docstring)."""
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    if quantile == 1 or mask.numel() == 0:
        return mask.clone()
    values = torch.where(mask, entropy.detach().float(), float("inf")).reshape(-1)
    ordered, _ = torch.sort(values)  # the n valid values first, ascending
    n = mask.sum().to(torch.float64)
    pos = (1.0 - quantile) * (n - 1).clamp(min=0)
    lo = pos.floor()
    lo_i, hi_i = lo.long(), pos.ceil().long()  # < n <= numel
    v_lo, v_hi = ordered[lo_i], ordered[hi_i]
    threshold = torch.lerp(v_lo, v_hi, (pos - lo).float())
    threshold = torch.where(hi_i == lo_i, v_lo, threshold)  # an exact position: the value itself
    return mask & (entropy.detach().float() >= threshold)
