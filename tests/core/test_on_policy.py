"""The on-policy sanity check that separates per-sequence from per-token normalisation."""

from __future__ import annotations

import torch

from portarl.core import GRPOConfig, compute_advantages, compute_loss


def _batch():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([2, 7, 3, 9, 1, 5])  # unequal on purpose
    mask = torch.arange(9)[None, :] < lengths[:, None]
    logp = -torch.rand(6, 9, generator=gen) * 3
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.0, 0.2])
    adv = compute_advantages(rewards, group_size=3).advantages
    return logp, adv, mask


def test_on_policy_seq_mean_token_mean_is_zero_with_nonzero_gradient():
    logp, adv, mask = _batch()
    leaf = logp.clone().requires_grad_(True)
    loss, _ = compute_loss(leaf, logp, adv, mask, config=GRPOConfig(loss_agg_mode="seq-mean-token-mean"))
    # ratio = 1, so each sequence contributes -A_i and group-normalised advantages sum to 0
    # within each group: the mean over sequences is 0.
    assert abs(loss.item()) < 1e-7
    loss.backward()
    assert leaf.grad.abs().max() > 1e-3  # d/dlogp of -A * ratio is -A * ratio / n_i != 0


def test_on_policy_token_mean_with_unequal_lengths_is_not_zero():
    logp, adv, mask = _batch()
    leaf = logp.clone().requires_grad_(True)
    loss, _ = compute_loss(leaf, logp, adv, mask, config=GRPOConfig(loss_agg_mode="token-mean"))
    # token-mean weighs sequence i by its length: -sum_i A_i |o_i| / sum_i |o_i|, and the
    # advantages sum to zero per group, not their length-weighted sum.
    lengths = mask.sum(-1).float()
    expected = -(adv * lengths).sum() / lengths.sum()
    assert abs(loss.item()) > 1e-3
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    loss.backward()
    assert leaf.grad.abs().max() > 1e-3
