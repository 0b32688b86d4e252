"""GAE and the clipped value loss (portarl.core.gae) against a float64 reference written
from the formulas and against verl's code on the same data (tests/core/verl_reference.py):
padded rows, packed-style rows of other lengths, and masks with holes (multi-turn episodes:
tool and environment tokens the policy did not produce)."""

from __future__ import annotations

import pytest
import torch

import verl_reference as verl
from portarl.core.gae import compute_gae, explained_variance, outcome_token_rewards, value_loss

ATOL = 1e-6  # float32 results of a float64 recursion


def _data(seed: int, holes: bool):
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 11
    lengths = torch.tensor([11, 7, 1, 5, 9, 3])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if holes:  # an episode: model turn, tool output (not the model's), model turn
        mask[0, 3:6] = False
        mask[4, 2] = False
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    rewards = torch.randn(b, generator=gen, dtype=torch.float64)
    token_rewards = outcome_token_rewards(rewards, mask).double() + 0.01 * torch.randn(b, t, generator=gen,
                                                                                        dtype=torch.float64) * mask
    return token_rewards, values, mask


def _formulas(token_rewards, values, mask, gamma, lam):
    """Row by row over the model's own tokens: A_t = sum_l (gamma lam)^l delta_{t+l}, the
    next value being the next model token's (0 after the last)."""
    b, t = values.shape
    adv = torch.zeros(b, t, dtype=torch.float64)
    for row in range(b):
        idx = [i for i in range(t) if mask[row, i]]
        for k, i in enumerate(idx):
            total = 0.0
            for j, pos in enumerate(idx[k:]):
                nxt = values[row, idx[k + j + 1]] if k + j + 1 < len(idx) else 0.0
                delta = token_rewards[row, pos] + gamma * nxt - values[row, pos]
                total += (gamma * lam) ** j * delta
            adv[row, i] = total
    returns = (adv + values) * mask
    m = mask.double()
    mean = (adv * m).sum() / m.sum()
    var = (((adv - mean) * m) ** 2).sum() / (m.sum() - 1)
    return (adv - mean) / torch.sqrt(var + 1e-8) * m, returns


@pytest.mark.parametrize("holes", [False, True], ids=["padded", "episode-holes"])
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_the_formulas_and_verl(holes, gamma, lam):
    token_rewards, values, mask = _data(3, holes)
    adv, returns = compute_gae(token_rewards.float(), values.float(), mask, gamma=gamma, lam=lam)
    want_adv, want_ret = _formulas(token_rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), want_adv, rtol=0, atol=ATOL * 10)
    torch.testing.assert_close(returns.double(), want_ret, rtol=0, atol=ATOL * 10)
    v_adv, v_ret = verl.compute_gae_advantage_return(token_rewards * mask, values * mask, mask.double(), gamma, lam)
    torch.testing.assert_close(adv.double()[mask], v_adv[mask], rtol=0, atol=ATOL * 10)
    torch.testing.assert_close(returns.double()[mask], v_ret[mask], rtol=0, atol=ATOL * 10)
    assert torch.count_nonzero(adv[~mask]) == 0 and torch.count_nonzero(returns[~mask]) == 0


def test_the_outcome_reward_sits_on_each_rows_last_model_token():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    got = outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert got.tolist() == [[0, 2.0, 0, 0], [0, 0, 3.0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_verl_and_its_gradient_is_the_formulas(clip):
    _, values, mask = _data(5, True)
    gen = torch.Generator().manual_seed(9)
    returns = values + torch.randn(values.shape, generator=gen, dtype=torch.float64)
    vpreds = (values + 0.5 * torch.randn(values.shape, generator=gen, dtype=torch.float64)).float().requires_grad_(True)
    loss, metrics = value_loss(vpreds, returns.float(), values.float(), mask, cliprange=clip)
    if clip is not None:
        v_loss, v_frac = verl.compute_value_loss(vpreds.detach().double(), returns, values, mask.double(), clip)
        assert float(loss.detach()) == pytest.approx(float(v_loss), abs=1e-6)
        assert float(metrics["value/clipfrac"]) == pytest.approx(float(v_frac), abs=1e-6)
    loss.backward()
    v = vpreds.detach().double()
    if clip is None:
        want = (v - returns) * mask / mask.sum()  # d/dv of 0.5 mean (v - R)^2
    else:
        clipped = values + (v - values).clamp(-clip, clip)
        use_clipped = (clipped - returns) ** 2 > (v - returns) ** 2
        inside = (v - values).abs() < clip
        grad_clipped = torch.where(inside, clipped - returns, torch.zeros_like(v))
        want = torch.where(use_clipped, grad_clipped, v - returns) * mask / mask.sum()
    torch.testing.assert_close(vpreds.grad.double(), want, rtol=0, atol=1e-6)


def test_refusals_and_explained_variance():
    _, values, mask = _data(1, False)
    with pytest.raises(ValueError, match="gamma must be in"):
        compute_gae(values, values, mask, gamma=1.5)
    bad = values.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        compute_gae(bad, values, mask)
    assert explained_variance(values, values, mask) == pytest.approx(1.0)
    assert explained_variance(values * 0, values, mask) == pytest.approx(0.0, abs=0.2)
