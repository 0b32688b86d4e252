"""Entropy masking (TRL's top_entropy_quantile): the kept share, exact zero gradient on the
masked tokens, and TRL 1.16's loss on identical inputs."""

from __future__ import annotations

import pytest
import torch

from portarl.core import GRPOConfig, compute_loss
from portarl.core.entropy_mask import high_entropy_mask
from portarl.parity.errors import assert_close
from portarl.parity.tolerances import fp32_result


def _batch(seed, b=6, t=11):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen) * 4
    logp = old + 0.3 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, generator=gen)
    entropy = torch.rand(b, t, generator=gen) * 3
    mask = torch.rand(b, t, generator=gen) < 0.75
    mask[:, 0] = True
    return logp, old, adv, entropy, mask


@pytest.mark.parametrize("q", [0.05, 0.2, 0.25, 0.5, 0.8, 0.99])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_fraction_is_q_within_one_token(q, seed):
    _, _, _, entropy, mask = _batch(seed)
    keep = high_entropy_mask(entropy, mask, q)
    n, k = int(mask.sum()), int(keep.sum())
    assert abs(k - q * n) <= 1, (k, q * n)
    assert not (keep & ~mask).any()  # padding never kept
    # The kept tokens are the highest-entropy ones.
    assert entropy[keep].min() > entropy[mask & ~keep].max()
    # torch.quantile's threshold (TRL's rule) keeps the same tokens.
    threshold = torch.quantile(entropy[mask], 1 - q)
    assert torch.equal(keep, mask & (entropy >= threshold))


def test_edge_cases():
    entropy = torch.tensor([[0.5, 0.1, 0.9]])
    assert not high_entropy_mask(entropy, torch.zeros(1, 3, dtype=torch.bool), 0.2).any()
    one = torch.tensor([[False, True, False]])
    assert torch.equal(high_entropy_mask(entropy, one, 0.2), one)  # a single valid token is its own quantile
    assert torch.equal(high_entropy_mask(entropy, torch.ones(1, 3, dtype=torch.bool), 1.0), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="quantile"):
        high_entropy_mask(entropy, one, 0.0)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        GRPOConfig(top_entropy_quantile=1.5)


@pytest.mark.parametrize("name", ["ppo_clip", "cispo", "sapo"])
def test_masked_tokens_get_exactly_zero_gradient(name):
    logp, _, adv, entropy, mask = _batch(5)
    old = logp + 0.01  # inside every clip range: every kept token has a gradient
    config = GRPOConfig(policy_loss=name, top_entropy_quantile=0.2)
    leaf = logp.clone().requires_grad_(True)
    loss, metrics = compute_loss(leaf, old, adv, mask, config=config, entropy=entropy)
    (grad,) = torch.autograd.grad(loss, leaf)
    keep = high_entropy_mask(entropy, mask, 0.2)
    assert (grad[~keep] == 0).all()  # exactly zero, not small
    assert (grad[keep] != 0).all()
    assert metrics["pg/entropy_kept_frac"].item() == pytest.approx(int(keep.sum()) / int(mask.sum()))
    # Same loss as masking the per-token loss by hand (the normaliser keeps every valid token).
    full = GRPOConfig(policy_loss=name)
    leaf2 = logp.clone().requires_grad_(True)
    loss_all, _ = compute_loss(leaf2, old, adv, mask, config=full, entropy=entropy)
    (grad_all,) = torch.autograd.grad(loss_all, leaf2)
    torch.testing.assert_close(grad[keep], grad_all[keep], rtol=0, atol=0)


def test_needs_the_entropy():
    logp, old, adv, _, mask = _batch(0)
    with pytest.raises(ValueError, match="needs entropy"):
        compute_loss(logp, old, adv, mask, config=GRPOConfig(top_entropy_quantile=0.5))


@pytest.mark.parametrize("q", [0.2, 0.6])
def test_matches_trl_on_identical_inputs(q):
    """TRL's ``dapo`` loss type (token sum over the batch's token count) with
    ``top_entropy_quantile``; portarl's ppo_clip without dual clip (TRL has none) and
    ``token-mean``."""
    from tests.core.trl_loss import trl_loss

    logp, old, adv, entropy, mask = _batch(7, b=8, t=13)
    theirs_leaf = logp.clone().requires_grad_(True)
    theirs = trl_loss("dapo", theirs_leaf, old, adv, mask, entropies=entropy, top_entropy_quantile=q,
                      epsilon=0.2, epsilon_high=0.28)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_leaf)
    config = GRPOConfig(dual_clip=None, top_entropy_quantile=q, mismatch_mode=None)
    leaf = logp.clone().requires_grad_(True)
    loss, _ = compute_loss(leaf, old, adv, mask, config=config, entropy=entropy)
    (grad,) = torch.autograd.grad(loss, leaf)
    scale = 2.0 * float(adv.abs().max())
    assert_close(loss, theirs, fp32_result(scale), "entropy-masked loss vs TRL")
    assert_close(grad, theirs_grad, fp32_result(scale), "entropy-masked gradient vs TRL")
    assert torch.equal(grad == 0, theirs_grad == 0)  # the same tokens masked
