"""Rollout-mismatch correction: every mode by hand, metrics, non-finite inputs."""

from __future__ import annotations

import math

import pytest
import torch

from portarl.core import GRPOConfig, compute_loss, correct_mismatch

# d = old - rollout per token: w = e^d
D = torch.tensor([[math.log(3.0), math.log(0.25), 0.0], [math.log(1.5), math.log(1.5), 0.0]])
ROLL = torch.full((2, 3), -2.0)
OLD = ROLL + D
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_token_truncate():
    out = correct_mismatch(OLD, ROLL, MASK, "token_truncate")
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 0.25, 1.0], [1.5, 1.5, 0.0]]))
    assert torch.equal(out.mask, MASK)


def test_token_mask():
    out = correct_mismatch(OLD, ROLL, MASK, "token_mask", mask_low=0.5, mask_high=2.0)
    assert out.mask.tolist() == [[False, False, True], [True, True, False]]
    torch.testing.assert_close(out.weights, torch.tensor([[0.0, 0.0, 1.0], [1.5, 1.5, 0.0]]))
    assert out.metrics["mismatch/masked_frac"].item() == pytest.approx(2 / 5)


def test_sequence_modes_use_the_geometric_mean():
    g0 = math.exp((math.log(3.0) + math.log(0.25) + 0.0) / 3)  # (0.75)^(1/3) = 0.908
    g1 = 1.5  # geometric mean of (1.5, 1.5) over its 2 valid tokens
    out = correct_mismatch(OLD, ROLL, MASK, "sequence_truncate", truncate_c=1.2)
    torch.testing.assert_close(out.weights, torch.tensor([[g0] * 3, [1.2, 1.2, 0.0]]))
    out = correct_mismatch(OLD, ROLL, MASK, "sequence_mask", mask_low=0.95, mask_high=2.0)
    assert out.mask.tolist() == [[False, False, False], [True, True, False]]
    torch.testing.assert_close(out.weights[1, :2], torch.tensor([g1, g1]))


def test_metrics():
    out = correct_mismatch(OLD, ROLL, MASK, "token_truncate")
    d = D[MASK]
    m = out.metrics
    assert m["mismatch/abs_diff_mean"].item() == pytest.approx(d.abs().mean().item(), rel=1e-6)
    assert m["mismatch/abs_diff_max"].item() == pytest.approx(math.log(4.0), rel=1e-6)
    assert m["mismatch/kl_k1"].item() == pytest.approx((-d).mean().item(), rel=1e-6)
    assert m["mismatch/kl_k3"].item() == pytest.approx((d.exp() - 1 - d).mean().item(), rel=1e-6)
    w = torch.tensor([2.0, 0.25, 1.0, 1.5, 1.5])
    assert m["mismatch/ess"].item() == pytest.approx((w.sum() ** 2 / (5 * (w**2).sum())).item(), rel=1e-6)


def test_identical_log_probs_give_unit_weights_and_full_ess():
    out = correct_mismatch(ROLL, ROLL, MASK, "token_mask")
    assert torch.equal(out.weights, MASK.float()) and out.metrics["mismatch/ess"].item() == pytest.approx(1.0)
    assert out.metrics["mismatch/kl_k3"].item() == 0.0


def test_nonfinite_tokens_are_dropped_and_counted():
    roll = ROLL.clone()
    roll[0, 1] = float("-inf")
    out = correct_mismatch(OLD, roll, MASK, "token_truncate")
    assert out.weights[0, 1].item() == 0.0 and not out.mask[0, 1]
    assert out.metrics["mismatch/nonfinite_frac"].item() == pytest.approx(1 / 5)
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_weights_scale_the_policy_loss_in_compute_loss():
    logp = OLD.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    plain, _ = compute_loss(logp, OLD, adv, MASK, config=GRPOConfig())
    corrected, m = compute_loss(logp, OLD, adv, MASK, config=GRPOConfig(), rollout_logp=ROLL)
    # on-policy w.r.t. old: pg per token = -A; weighted by min(w, 2), token-mean over 5
    expected = -(1.0 * (2.0 + 0.25 + 1.0) - 1.0 * (1.5 + 1.5)) / 5
    assert corrected.item() == pytest.approx(expected, rel=1e-6)
    assert plain.item() == pytest.approx(-(3 - 2) / 5, rel=1e-6)
    assert "mismatch/ess" in m
    _, m = compute_loss(logp, OLD, adv, MASK, config=GRPOConfig(mismatch_mode=None), rollout_logp=ROLL)
    assert "mismatch/kl_k3" in m  # metrics without correction


def test_errors():
    with pytest.raises(ValueError, match="mismatch mode 'tis'"):
        correct_mismatch(OLD, ROLL, MASK, "tis")
    with pytest.raises(ValueError, match="mask_low < 1 < mask_high"):
        correct_mismatch(OLD, ROLL, MASK, "token_mask", mask_low=0.5, mask_high=0.9)
