"""Rollout-mismatch correction: importance weights between the rollout engine and the trainer.

The rollout engine (vLLM, say) samples with its own kernels and precision, so its
log-probs differ from the trainer's for the same policy: "on-policy" training is quietly
off-policy. With d = old_logp - rollout_logp (trainer minus rollout, per token) the
importance weight of a token is w = exp(d). Modes:

- ``token_truncate`` (truncated IS, the common default): weight min(w, C), C = 2.
- ``token_mask``: tokens with w outside [low, high] are dropped from the loss; kept tokens
  carry weight w (bounded by the band).
- ``sequence_truncate`` / ``sequence_mask``: the same on the sequence's *geometric-mean*
  weight w_seq = exp(mean_t d), applied to all its tokens.

Why the geometric mean: the exact sequence weight is the product of token weights,
exp(sum_t d), which grows or shrinks exponentially with length: long sequences would be
truncated or masked almost always and short ones almost never (a length bias), and the
weights' variance explodes. The geometric mean is a per-token average on the log scale,
comparable across lengths, and is the same normalisation GSPO uses for its ratio.

Weights carry no gradient. d is clamped to [-20, 20] before exp. Tokens where either
log-prob is not finite get weight 0 and are dropped (counted in ``nonfinite_frac``).
Metrics over valid tokens: mean / max |d|, k1 and k3 estimates of KL(rollout || trainer),
fraction of tokens masked, and the normalised effective sample size
(sum w)^2 / (n * sum w^2) in (0, 1] of the final weights.
"""

from __future__ import annotations

import dataclasses

import torch

from portarl.core._checks import check_mask, check_positive, check_tokens, masked_max, masked_mean

MISMATCH_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LOG_RATIO_CLAMP = 20.0


@dataclasses.dataclass
class MismatchCorrection:
    """``weights`` [B, T] fp32 (0 where dropped), ``mask`` [B, T] (tokens still in the loss), metrics."""

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, torch.Tensor]


def correct_mismatch(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str | None = "token_truncate",
    *,
    truncate_c: float = 2.0,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
) -> MismatchCorrection:
    """Importance weights from rollout to trainer log-probs. ``mode=None``: weights 1
    (metrics only)."""
    check_tokens("old_logp", old_logp)
    check_tokens("rollout_logp", rollout_logp, old_logp)
    mask = check_mask(mask, old_logp)
    if mode is not None and mode not in MISMATCH_MODES:
        raise ValueError(f"mismatch mode {mode!r} is not one of {', '.join(MISMATCH_MODES)} (or None)")
    truncate_c = check_positive("truncate_c", truncate_c, minimum=1.0, inclusive=True)
    mask_low = check_positive("mask_low", mask_low)
    mask_high = check_positive("mask_high", mask_high)
    if not mask_low < 1.0 < mask_high:
        raise ValueError(f"need mask_low < 1 < mask_high, got [{mask_low}, {mask_high}]")

    with torch.no_grad():
        old, roll = old_logp.detach().float(), rollout_logp.detach().float()
        finite = torch.isfinite(old) & torch.isfinite(roll)
        valid = mask & finite
        d = torch.where(valid, old - roll, torch.zeros_like(old))
        d = torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        w_token = torch.exp(d)
        lengths = valid.sum(dim=-1, keepdim=True)
        w_seq = torch.exp(d.sum(dim=-1, keepdim=True) / lengths.clamp(min=1)).expand_as(d)
        keep = valid
        if mode is None:
            weights = torch.ones_like(d)
        elif mode == "token_truncate":
            weights = torch.clamp(w_token, max=truncate_c)
        elif mode == "sequence_truncate":
            weights = torch.clamp(w_seq, max=truncate_c)
        elif mode == "token_mask":
            keep = valid & (w_token >= mask_low) & (w_token <= mask_high)
            weights = w_token
        else:  # sequence_mask
            keep = valid & (w_seq >= mask_low) & (w_seq <= mask_high)
            weights = w_seq
        weights = torch.where(keep, weights, torch.zeros_like(weights))

        n = keep.sum().clamp(min=1)
        ess = weights.sum().square() / (n * weights.square().sum()).clamp(min=1e-30)
        metrics = {
            "mismatch/abs_diff_mean": masked_mean(d.abs(), valid),
            "mismatch/abs_diff_max": masked_max(d.abs(), valid),
            # Samples come from the rollout policy: KL(rollout || trainer) = E[-d].
            "mismatch/kl_k1": masked_mean(-d, valid),
            "mismatch/kl_k3": masked_mean(w_token - 1.0 - d, valid),
            "mismatch/masked_frac": masked_mean((valid & ~keep).float(), mask),
            "mismatch/nonfinite_frac": masked_mean((~finite).float(), mask),
            "mismatch/weight_mean": masked_mean(weights, keep),
            "mismatch/ess": torch.where(keep.any(), ess, weights.new_zeros(())),  # no host sync
        }
    return MismatchCorrection(weights, keep, metrics)
