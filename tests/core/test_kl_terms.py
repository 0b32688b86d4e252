"""KL regularisation: the k3 gradient identity, the loss term, KL in the reward, -inf refs."""

from __future__ import annotations

import pytest
import torch

from portarl.core import GRPOConfig, compute_loss, kl_penalized_rewards, kl_per_token


def test_k3_gradient_is_one_minus_exp_inside_the_clamp(target, monkeypatch):
    monkeypatch.setenv("PORTARL_BACKEND", target.backend)  # core dispatches by device; force this target
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 16, generator=gen) * 3
    ref = logp + 1.5 * torch.randn(4, 16, generator=gen)
    mask = torch.ones(4, 16, dtype=torch.bool)
    leaf = logp.to(target.device).requires_grad_(True)
    kl, _, _ = kl_per_token(leaf, ref.to(target.device), mask.to(target.device), estimator="k3")
    kl.sum().backward()
    d = ref.double() - logp.double()
    inside = (d.exp() - d - 1) < 10.0  # the value cap; |d| < 20 everywhere here
    assert inside.any() and (~inside).any()
    expected = torch.where(inside, 1 - d.exp(), 0.0)
    torch.testing.assert_close(leaf.grad.cpu().double(), expected, rtol=1e-5, atol=1e-6)


def test_kl_loss_term_uses_the_same_aggregation():
    logp = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-0.5, -3.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.zeros(2)
    for mode in ("token-mean", "seq-mean-token-mean"):
        loss, m = compute_loss(logp, logp, adv, mask, config=GRPOConfig(kl_coef=0.5, loss_agg_mode=mode), ref_logp=ref)
        d = (ref - logp)[mask]
        k3 = d.exp() - d - 1
        if mode == "token-mean":
            expected = k3.mean()
        else:
            expected = (k3[:3].mean() + k3[3:].mean()) / 2
        assert m["kl/loss"].item() == pytest.approx(expected.item(), rel=1e-6)
        assert loss.item() == pytest.approx(0.5 * expected.item(), rel=1e-6)


def test_kl_in_reward_subtracts_k1_sum():
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0], [-2.0, -1.0]])
    mask = torch.tensor([[True, True], [True, False]])
    rewards = torch.tensor([1.0, 0.0])
    out, m = kl_penalized_rewards(rewards, logp, ref, mask, kl_coef=0.1)
    # k1 = logp - ref: row 0: 0.5 + (-1.0) = -0.5; row 1: 1.0
    torch.testing.assert_close(out, torch.tensor([1.0 + 0.05, 0.0 - 0.1]))
    assert m["kl/reward_penalty"].item() == pytest.approx((-0.05 + 0.1) / 2)
    # kl_in_reward means no KL loss term, and ref_logp is optional in compute_loss
    loss, m = compute_loss(logp, logp, torch.zeros(2), mask, config=GRPOConfig(kl_coef=0.1, kl_in_reward=True))
    assert "kl/loss" not in m


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_neg_inf_reference_is_left_out_and_flagged(estimator):
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[float("-inf"), -1.5, float("nan")]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    cfg = GRPOConfig(kl_coef=1.0, kl_estimator=estimator)
    loss, m = compute_loss(logp, logp.detach(), torch.tensor([1.0]), mask, config=cfg, ref_logp=ref)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert m["kl/nonfinite_ref_frac"].item() == pytest.approx(2 / 3)


def test_kl_needs_ref_logp():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logp"):
        compute_loss(x, x, torch.ones(1), torch.ones(1, 2), config=GRPOConfig(kl_coef=0.1))
