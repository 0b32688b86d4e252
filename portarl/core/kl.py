"""KL regularisation against a reference policy, with the estimators of portarl.ops.kl.

Two ways, chosen by ``GRPOConfig.kl_in_reward``:
- a loss term: ``kl_coef * aggregate_loss(kl_per_token(...))``, same aggregation as the
  policy term (k3 by default: low variance; its gradient estimates the forward KL);
- in the reward: ``kl_penalized_rewards`` subtracts ``kl_coef * sum_t k1`` from each
  sequence's reward before advantages are computed (no gradient through it).

Tokens whose reference log-prob is not finite (-inf: the reference gives the sampled token
probability 0, or NaN) are left out of the KL term and counted in
``kl/nonfinite_ref_frac``: k1 and k2 would be infinite there and k3 only its cap.
"""

from __future__ import annotations

import torch

from portarl import ops
from portarl.core._checks import check_mask, check_tokens, masked_mean


def kl_per_token(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, *, estimator: str = "k3",
    log_ratio_clamp: float | None = 20.0, max_value: float | None = 10.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(kl [B, T] fp32, kl_mask [B, T], metrics)``; kl_mask is mask minus non-finite references."""
    check_tokens("ref_logp", ref_logp, logp)
    mask = check_mask(mask, logp)
    finite_ref = torch.isfinite(ref_logp)
    kl_mask = mask & finite_ref
    values = ops.kl(
        logp, ref_logp.detach(), estimator=estimator, mask=kl_mask,
        log_ratio_clamp=log_ratio_clamp, max_value=max_value,
    )
    with torch.no_grad():
        metrics = {
            "kl/value": masked_mean(values.detach(), kl_mask),
            "kl/nonfinite_ref_frac": masked_mean((~finite_ref).float(), mask),
        }
        if max_value is not None and estimator == "k3":
            metrics["kl/capped_frac"] = masked_mean((values.detach() >= max_value).float(), kl_mask)
    return values, kl_mask, metrics


def kl_penalized_rewards(
    rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kl_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``rewards - kl_coef * sum_t k1`` per sequence (detached), and the mean penalty."""
    if rewards.dim() != 1 or rewards.shape[0] != logp.shape[0]:
        raise ValueError(f"rewards must be [batch={logp.shape[0]}], got {tuple(rewards.shape)}")
    with torch.no_grad():
        k1, kl_mask, metrics = kl_per_token(logp.detach(), ref_logp, mask, estimator="k1")
        penalty = kl_coef * torch.where(kl_mask, k1, torch.zeros_like(k1)).sum(dim=-1)
    metrics["kl/reward_penalty"] = penalty.mean() if penalty.numel() else penalty.new_zeros(())
    return rewards - penalty.to(rewards.dtype), metrics
