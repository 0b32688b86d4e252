"""Extreme inputs give finite losses and gradients, and the metric that flags them."""

from __future__ import annotations

import pytest
import torch

from portarl.core import GRPOConfig, compute_advantages, compute_loss

POLICIES = ["ppo_clip", "gspo", "reinforce"]


def _check_finite(loss, leaf):
    loss.backward()
    assert torch.isfinite(loss), loss
    assert torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("policy", POLICIES)
def test_log_ratios_of_plus_minus_50(policy):
    old = torch.full((2, 3), -5.0)
    leaf = (old + torch.tensor([[50.0, -50.0, 0.0], [-50.0, 50.0, 1.0]])).requires_grad_(True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, m = compute_loss(leaf, old, torch.tensor([1.0, -1.0]), mask, config=GRPOConfig(policy_loss=policy))
    _check_finite(loss, leaf)
    if policy != "gspo":
        assert m["pg/log_ratio_clamped_frac"].item() == pytest.approx(4 / 6)
        assert m["pg/ratio_max"].item() == pytest.approx(torch.tensor(20.0).exp().item(), rel=1e-6)
    else:  # the sequence means of the log-ratios are 0 and 1/3: gspo's ratios stay tame
        assert m["pg/ratio_max"].item() == pytest.approx(torch.tensor(1 / 3).exp().item(), rel=1e-6)


@pytest.mark.parametrize("policy", POLICIES)
def test_neg_inf_reference(policy):
    leaf = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[float("-inf"), -2.5]])
    loss, m = compute_loss(
        leaf, leaf.detach(), torch.tensor([0.5]), torch.ones(1, 2), config=GRPOConfig(policy_loss=policy, kl_coef=0.1),
        ref_logp=ref,
    )
    _check_finite(loss, leaf)
    assert m["kl/nonfinite_ref_frac"].item() == 0.5


@pytest.mark.parametrize("policy", POLICIES)
def test_all_rewards_equal(policy):
    adv = compute_advantages(torch.full((4,), 0.5), 4)
    leaf = torch.full((4, 3), -1.0, requires_grad=True)
    loss, _ = compute_loss(leaf, leaf.detach(), adv.advantages, torch.ones(4, 3), config=GRPOConfig(policy_loss=policy))
    _check_finite(loss, leaf)
    assert loss.item() == 0.0 and adv.metrics["frac_zero_std"].item() == 1.0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_empty_completions(policy, mode):
    leaf = torch.tensor([[-1.0, -2.0], [float("nan"), float("nan")], [-0.5, -0.1]], requires_grad=True)
    mask = torch.tensor([[True, True], [False, False], [True, False]])
    cfg = GRPOConfig(policy_loss=policy, loss_agg_mode=mode, max_response_length=2)
    loss, m = compute_loss(leaf, leaf.detach(), torch.tensor([1.0, 2.0, -1.0]), mask, config=cfg)
    _check_finite(loss, leaf)
    assert m["guard/empty_seq_frac"].item() == pytest.approx(1 / 3)
    # everything empty: loss 0, still differentiable
    leaf2 = torch.zeros(2, 2, requires_grad=True)
    loss, m = compute_loss(leaf2, leaf2.detach(), torch.ones(2), torch.zeros(2, 2), config=cfg)
    _check_finite(loss, leaf2)
    assert loss.item() == 0.0 and m["guard/empty_seq_frac"].item() == 1.0


def test_nonfinite_logp_on_a_valid_token_is_dropped_and_flagged():
    leaf = torch.tensor([[-1.0, float("nan"), -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, float("-inf")]])
    loss, m = compute_loss(leaf, old, torch.tensor([1.0]), torch.ones(1, 3), config=GRPOConfig())
    _check_finite(loss, leaf)
    assert m["guard/nonfinite_token_frac"].item() == pytest.approx(2 / 3)
    with pytest.raises(FloatingPointError, match="non-finite logp/old_logp"):
        compute_loss(leaf, old, torch.tensor([1.0]), torch.ones(1, 3), config=GRPOConfig(drop_nonfinite_tokens=False))
