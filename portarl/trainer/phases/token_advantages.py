"""Per-token advantages of PPO with a value model (``loss.advantage_estimator: gae``): the
critic's values of the batch (:mod:`portarl.trainer.phases.critic`), the outcome reward on
each response's last model token, GAE (:mod:`portarl.core.gae`) with ``critic.gamma`` /
``critic.lam``, and the advantages whitened over every rank's tokens (under torchrun the
same statistics as one process over the whole batch)."""

from __future__ import annotations

import torch

from portarl.core.gae import compute_gae, outcome_token_rewards


def whiten_everywhere(trainer, adv: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(adv - mean) / sqrt(var + eps) with the masked tokens of every rank (unbiased variance,
    verl's ``masked_whiten``); masked-out entries 0."""
    m = mask.to(torch.float64)
    a = adv.to(torch.float64)
    sums = torch.stack([(a * m).sum(), (a * a * m).sum(), m.sum()]).cpu()
    if trainer.dist.enabled:
        sums = _sum_f64(trainer, sums)
    total, squares, n = sums.tolist()
    mean = total / max(n, 1.0)
    var = (squares - n * mean * mean) / max(n - 1.0, 1.0)
    return ((a - mean) / (var + eps) ** 0.5 * m).to(torch.float32)


def _sum_f64(trainer, sums: torch.Tensor) -> torch.Tensor:
    """Float64 sums over the ranks (Gloo's host group: exact enough for a mean and variance)."""
    import torch.distributed as dist

    out = sums.clone()
    dist.all_reduce(out, group=trainer.dist.host_group)
    return out


def gae_advantages(trainer, batch, rewards: torch.Tensor, metrics: dict):
    """``(advantages [B, T], values [B, T], returns [B, T])`` of this rank's rows; adds the
    value metrics."""
    c = trainer.config.critic
    values = trainer.critic.scored_values(batch)
    token_rewards = outcome_token_rewards(rewards.to(batch.labels.device), batch.mask)
    adv, returns = compute_gae(token_rewards, values, batch.mask, gamma=c.gamma, lam=c.lam, whiten=False)
    adv = whiten_everywhere(trainer, adv, batch.mask)
    mask = batch.mask.bool()
    metrics["adv/token_abs_max"] = float(adv.abs().max()) if mask.any() else 0.0
    return adv.to(batch.labels.device), values, returns.to(batch.labels.device)


__all__ = ["gae_advantages", "whiten_everywhere"]
