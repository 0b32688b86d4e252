"""Advantage estimators on hand-computed examples, zero-spread groups, errors, registry."""

from __future__ import annotations

import math

import pytest
import torch

from portarl.core import ADVANTAGE_ESTIMATORS, compute_advantages

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 3.0])  # two groups of 3


def test_grpo_group_scale():
    adv = compute_advantages(R, 3, eps=0.0).advantages
    s1 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased std of (1, 0, 0)
    expected = [(2 / 3) / s1, -(1 / 3) / s1, -(1 / 3) / s1, -1.0, 0.0, 1.0]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    assert adv.dtype == torch.float32


def test_grpo_batch_scale_and_dr_grpo():
    batch_std = R.double().std().item()
    adv = compute_advantages(R, 3, scale="batch", eps=0.0).advantages
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 0.0, 1.0]) / batch_std
    torch.testing.assert_close(adv, expected.float(), rtol=1e-6, atol=1e-7)
    adv = compute_advantages(R, 3, scale="none").advantages
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 0.0, 1.0]))


def test_rloo_leave_one_out():
    adv = compute_advantages(R, 3, estimator="rloo").advantages
    # r_i - mean of the other two
    expected = [1 - 0, 0 - 0.5, 0 - 0.5, 1 - 2.5, 2 - 2.0, 3 - 1.5]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_reinforce_pp_group_mean_then_batch_whitening():
    adv = compute_advantages(R, 3, estimator="reinforce_pp", eps=0.0).advantages
    centered = torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 0.0, 1.0], dtype=torch.float64)
    expected = (centered - centered.mean()) / centered.std()
    torch.testing.assert_close(adv, expected.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_zero_spread_group_is_zero_and_counted(estimator):
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.0, 1.0, 1.0, 5.0, 5.0, 5.0])
    out = compute_advantages(rewards, 3, estimator=estimator)
    assert torch.isfinite(out.advantages).all()
    assert torch.equal(out.advantages[:3], torch.zeros(3)) and torch.equal(out.advantages[6:], torch.zeros(3))
    assert out.advantages[3:6].abs().sum() > 0
    assert out.metrics["frac_zero_std"].item() == pytest.approx(2 / 3)
    assert out.keep.all()


def test_all_rewards_equal():
    out = compute_advantages(torch.ones(8), 4)
    assert torch.equal(out.advantages, torch.zeros(8)) and out.metrics["frac_zero_std"].item() == 1.0
    out = compute_advantages(torch.ones(8), 4, estimator="reinforce_pp")
    assert torch.equal(out.advantages, torch.zeros(8))


def test_drop_zero_std_marks_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    out = compute_advantages(rewards, 2, drop_zero_std=True)
    assert out.keep.tolist() == [False, False, True, True]
    assert out.metrics["frac_kept"].item() == 0.5


def test_group_size_one_is_zero_spread():
    out = compute_advantages(torch.tensor([1.0, 2.0]), 1)
    assert torch.equal(out.advantages, torch.zeros(2)) and out.metrics["frac_zero_std"].item() == 1.0


def test_errors():
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        compute_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match=r"non-finite at indices \[1\]"):
        compute_advantages(torch.tensor([0.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; registered: grpo, reinforce_pp, rloo"):
        compute_advantages(torch.ones(4), 2, estimator="ppo")
    with pytest.raises(TypeError, match="unknown option"):
        compute_advantages(torch.ones(4), 2, whiten=True)
    with pytest.raises(ValueError, match="rloo needs group_size >= 2"):
        compute_advantages(torch.tensor([0.0, 1.0]), 1, estimator="rloo")
    with pytest.raises(ValueError, match="scale='std'"):
        compute_advantages(torch.tensor([0.0, 1.0]), 2, scale="std")
    with pytest.raises(ValueError, match="rewards must be a 1-D tensor"):
        compute_advantages(torch.ones(2, 2), 2)


def test_registry_is_extensible():
    @ADVANTAGE_ESTIMATORS.register("test_sign")
    def sign(grouped, zero_std):
        return torch.sign(grouped - grouped.mean(dim=1, keepdim=True))

    try:
        adv = compute_advantages(torch.tensor([3.0, 1.0]), 2, estimator="test_sign").advantages
        assert adv.tolist() == [1.0, -1.0]
        with pytest.raises(ValueError, match="already registered"):
            ADVANTAGE_ESTIMATORS.register("test_sign")(sign)
    finally:
        ADVANTAGE_ESTIMATORS._items.pop("test_sign")
