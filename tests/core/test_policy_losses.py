"""Policy losses on hand-computed examples, and their gradients against autograd on float64
references written from the papers' formulas."""

from __future__ import annotations

import math

import pytest
import torch

from portarl.core import POLICY_LOSSES, policy_loss
from portarl.parity.errors import assert_close
from portarl.parity.tolerances import fp32_result


def _ppo_reference(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, c=3.0):
    """float64, per token: max(-A r, -A clip(r)), then min with -A c where A < 0."""
    r = torch.exp(torch.clamp(logp - old, -20, 20))
    a = adv.expand_as(r) if adv.dim() == 2 else adv
    loss = torch.maximum(-a * r, -a * torch.clamp(r, 1 - eps_low, 1 + eps_high))
    loss = torch.where(a < 0, torch.minimum(loss, -a * c), loss)
    return torch.where(mask, loss, 0.0)


def _gspo_reference(logp, old, adv, mask, eps_low=3e-4, eps_high=4e-4):
    n = mask.sum(-1, keepdim=True).clamp(min=1)
    s = torch.exp((torch.where(mask, logp - old, 0.0)).sum(-1, keepdim=True) / n)
    loss = torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - eps_low, 1 + eps_high))
    return torch.where(mask, loss.expand_as(logp), 0.0)


def test_ppo_clip_hand_example():
    # ratios e^(log r): 1.5 (A>0: clipped high at 1.28), 0.5 (A<0: clipped low at 0.8),
    # 5.0 (A<0: dual clip caps the loss at 3 * |A|), 1.1 (inside the clip).
    ratios = torch.tensor([[1.5, 0.5, 5.0, 1.1]])
    adv = torch.tensor([[1.0, -2.0, -1.0, 0.5]])
    old = torch.full((1, 4), -1.0)
    logp = old + torch.log(ratios)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = policy_loss("ppo_clip", logp, old, adv, mask)
    expected = torch.tensor([[-1.28, 2.0 * 0.8, 3.0, -0.55]])
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert m["clip_frac_high"].item() == 0.25 and m["clip_frac_low"].item() == 0.25
    assert m["dual_clip_frac"].item() == 0.25
    assert m["ratio_max"].item() == pytest.approx(5.0) and m["ratio_min"].item() == pytest.approx(0.5)
    expected_kl = sum(r - 1 - math.log(r) for r in ratios[0].tolist()) / 4
    assert m["approx_kl"].item() == pytest.approx(expected_kl, rel=1e-5)


def _random(seed, b=5, t=7, spread=0.3):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 4
    logp = old + spread * torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = torch.rand(b, t, generator=gen) < 0.8
    mask[0] = False  # an empty completion
    return logp, old, adv, mask


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "reinforce"])
def test_gradient_matches_float64_reference(name):
    logp64, old64, adv64, mask = _random(1, spread=0.3 if name != "gspo" else 1e-4)
    ref_fn = {
        "ppo_clip": lambda lp: _ppo_reference(lp, old64, adv64[:, None], mask),
        "gspo": lambda lp: _gspo_reference(lp, old64, adv64[:, None], mask),
        "reinforce": lambda lp: torch.where(mask, -adv64[:, None] * lp, 0.0),
    }[name]
    g = torch.randn(logp64.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    leaf64 = logp64.clone().requires_grad_(True)
    expected = ref_fn(leaf64)
    (expected_grad,) = torch.autograd.grad((expected * g).sum(), leaf64)

    leaf = logp64.float().requires_grad_(True)
    loss, _ = policy_loss(name, leaf, old64.float(), adv64.float(), mask)
    (grad,) = torch.autograd.grad((loss * g.float()).sum(), leaf)
    scale = 4.0 * float(adv64.abs().max())  # |logp| <= ~4 times |A|
    assert_close(loss, expected, fp32_result(scale), f"{name} loss")
    assert_close(grad, expected_grad, fp32_result(scale * float(g.abs().max())), f"{name} gradient")
    assert grad[0].abs().sum() == 0  # empty completion: no gradient


def test_gspo_uses_the_sequence_geometric_mean_ratio():
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.1, -0.2, 0.4]])
    mask = torch.tensor([[True, True, True]])
    s = math.exp((0.1 - 0.2 + 0.4) / 3)  # 1.105: clipped at 1 + 4e-4 for A > 0
    loss, m = policy_loss("gspo", logp, old, torch.tensor([2.0]), mask)
    torch.testing.assert_close(loss, torch.full((1, 3), -2.0 * (1 + 4e-4)))
    assert m["ratio_mean"].item() == pytest.approx(s, rel=1e-6)
    assert m["clip_frac_high"].item() == 1.0


def test_log_ratios_are_clamped_before_exp():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[50.0, -50.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    for name in POLICY_LOSSES.names():
        loss, m = policy_loss(name, logp, old, torch.tensor([[1.0, -1.0]]) if name != "gspo" else torch.tensor([1.0]), mask)
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), name
        assert m["log_ratio_clamped_frac"].item() > 0 or name == "gspo", name
        assert m["ratio_max"].item() <= math.exp(20) * (1 + 1e-6), name


def test_masked_positions_ignore_nan():
    logp = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.1, float("-inf")]])
    mask = torch.tensor([[True, False]])
    for name in POLICY_LOSSES.names():
        loss, _ = policy_loss(name, logp, old, torch.tensor([1.0]), mask)
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert loss[0, 1].item() == 0.0 and grad[0, 1].item() == 0.0 and torch.isfinite(grad).all(), name


def test_option_errors():
    x = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="eps_low must be < 1"):
        policy_loss("ppo_clip", x, x, torch.ones(1), mask, eps_low=1.5)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss("ppo_clip", x, x, torch.ones(1), mask, dual_clip=0.5)
    with pytest.raises(TypeError, match="unknown option"):
        policy_loss("ppo_clip", x, x, torch.ones(1), mask, clip=0.2)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'"):
        policy_loss("ppo", x, x, torch.ones(1), mask)
    with pytest.raises(ValueError, match="advantages has 2 entries but the batch has 1"):
        policy_loss("ppo_clip", x, x, torch.ones(2), mask)
    with pytest.raises(ValueError, match="old_logp shape"):
        policy_loss("ppo_clip", x, torch.zeros(1, 3), torch.ones(1), mask)
