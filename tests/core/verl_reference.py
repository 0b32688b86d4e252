"""verl's GAE, whitening and value loss, transcribed from verl 0.9.1
(``verl/trainer/ppo/core_algos.py``: ``compute_gae_advantage_return``, ``compute_value_loss``;
``verl/utils/torch_functional.py``: ``masked_mean``, ``masked_var``, ``masked_whiten``;
Apache License 2.0), as the peer reference tests/core/test_gae.py holds portarl's to. Only
the arithmetic is kept (token-mean aggregation), in float64."""

from __future__ import annotations

import torch


def masked_mean(values, mask):
    return (values * mask).sum() / (mask.sum() + 1e-8)


def masked_var(values, mask):
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    return variance * (n / (n - 1))


def masked_whiten(values, mask):
    return (values - masked_mean(values, mask)) * torch.rsqrt(masked_var(values, mask) + 1e-8)


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues, lastgaelam, reversed_ = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, response_mask), returns


def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value):
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    losses = torch.max((vpreds - returns) ** 2, (clipped - returns) ** 2)
    loss = 0.5 * masked_mean(losses, response_mask)
    clipfrac = masked_mean(torch.gt((clipped - returns) ** 2, (vpreds - returns) ** 2).double(), response_mask)
    return loss, clipfrac
