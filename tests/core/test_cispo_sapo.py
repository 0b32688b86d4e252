"""CISPO and SAPO: float64 re-derivations from the papers' equations (value and gradient),
hand examples, and TRL 1.16's implementation on identical inputs.

Written from the papers, not from portarl's code:

- CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): J = sum_t sg(r_hat_t) A_t log pi(o_t),
  r_hat = clip(r, 1 - eps_low^IS, 1 + eps_high^IS); the loss is -J per token.
- SAPO (arXiv 2511.20347, eq. 5-6): J = sum_t f(r_t) A_t, f(r) = 4/tau sigmoid(tau (r - 1)),
  tau = tau_pos when A > 0 else tau_neg.

Differences from TRL by design (checked below, not hidden): TRL's CISPO has no lower
clip (portarl's ``ratio_min`` defaults to None, the same); TRL aggregates per loss type
(cispo: token sum / token count, sapo: per-sequence token mean, then the mean), portarl by
``loss.loss_agg_mode``, so the comparison picks the matching mode (``token-mean`` /
``seq-mean-token-mean``). TRL's metric ``cispo_clip_ratio`` counts A > 0 only; portarl's
``clip_frac_high`` counts every clipped weight.
"""

from __future__ import annotations

import pytest
import torch

from portarl.core import GRPOConfig, aggregate_loss, compute_loss, policy_loss
from portarl.parity.errors import assert_close
from portarl.parity.tolerances import fp32_result


def _inputs(seed, b=6, t=9, spread=0.6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 4
    logp = old + spread * torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    adv[1] = 0.0  # a zero advantage: sapo's negative temperature, no gradient
    mask = torch.rand(b, t, generator=gen) < 0.8
    mask[:, 0] = True
    mask[0] = False  # an empty completion
    return logp, old, adv, mask


def _cispo64(logp, old, adv, mask, r_max, r_min=None):
    r = torch.exp(logp.detach() - old)  # sg(): the weight is a constant
    r_hat = torch.clamp(r, min=r_min, max=r_max)
    return torch.where(mask, -(r_hat * adv[:, None] * logp), 0.0)


def _sapo64(logp, old, adv, mask, tau_pos, tau_neg):
    r = torch.exp(logp - old)
    tau = torch.where(adv[:, None] > 0, tau_pos, tau_neg).expand_as(r)
    f = 4.0 / tau * torch.sigmoid(tau * (r - 1.0))
    return torch.where(mask, -(f * adv[:, None]), 0.0)


CASES = [
    ("cispo", dict(ratio_max=5.0), lambda lp, o, a, m: _cispo64(lp, o, a, m, 5.0)),
    ("cispo", dict(ratio_max=1.2, ratio_min=0.8), lambda lp, o, a, m: _cispo64(lp, o, a, m, 1.2, 0.8)),
    ("sapo", dict(), lambda lp, o, a, m: _sapo64(lp, o, a, m, 1.0, 1.05)),
    ("sapo", dict(temperature_pos=4.0, temperature_neg=8.0), lambda lp, o, a, m: _sapo64(lp, o, a, m, 4.0, 8.0)),
]


@pytest.mark.parametrize("name,options,reference", CASES, ids=["cispo", "cispo-2sided", "sapo", "sapo-hot"])
def test_value_and_gradient_match_float64_paper_formula(name, options, reference):
    logp64, old64, adv64, mask = _inputs(3)
    upstream = torch.randn(logp64.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    leaf64 = logp64.clone().requires_grad_(True)
    expected = reference(leaf64, old64, adv64, mask)
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), leaf64)

    leaf = logp64.float().requires_grad_(True)
    loss, _ = policy_loss(name, leaf, old64.float(), adv64.float(), mask, **options)
    (grad,) = torch.autograd.grad((loss * upstream.float()).sum(), leaf)
    ratio_max = float(torch.exp(logp64 - old64)[mask].max())
    scale = 4.0 * float(adv64.abs().max()) * max(ratio_max, 4.0)  # |logp| <= 4, weights <= ratio / 4 / tau
    assert_close(loss, expected, fp32_result(scale), f"{name} loss")
    assert_close(grad, expected_grad, fp32_result(scale * float(upstream.abs().max())), f"{name} gradient")
    assert grad[0].abs().sum() == 0 and grad[1].abs().sum() == 0  # empty completion; zero advantage
    assert loss[~mask].abs().sum() == 0


def test_cispo_every_token_keeps_a_gradient():
    # Ratios far outside PPO's trust region: ppo_clip's gradient is 0 there, CISPO's is the
    # clipped weight times -A (d loss / d logp), whatever the ratio.
    ratios = torch.tensor([[0.1, 0.9, 1.0, 3.0, 40.0]])
    old = torch.full((1, 5), -2.0)
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 5, dtype=torch.bool)
    grads = {}
    for name in ("cispo", "ppo_clip"):
        leaf = (old + torch.log(ratios)).requires_grad_(True)
        loss, m = policy_loss(name, leaf, old, adv, mask)
        (grads[name],) = torch.autograd.grad(loss.sum(), leaf)
    torch.testing.assert_close(grads["cispo"], -torch.tensor([[0.1, 0.9, 1.0, 3.0, 5.0]]), rtol=1e-6, atol=0)
    assert grads["ppo_clip"][0, 3] == 0 and grads["ppo_clip"][0, 4] == 0  # clipped: no gradient
    _, m = policy_loss("cispo", old + torch.log(ratios), old, adv, mask)
    assert m["clip_frac_high"].item() == pytest.approx(0.2) and m["clip_frac_low"].item() == 0


def test_sapo_gate_is_plain_policy_gradient_on_policy_and_decays_off_policy():
    old = torch.full((2, 3), -1.5)
    ratios = torch.tensor([[1.0, 1.5, 4.0], [1.0, 0.5, 4.0]])
    adv = torch.tensor([2.0, -1.0])
    mask = torch.ones(2, 3, dtype=torch.bool)
    leaf = (old + torch.log(ratios)).requires_grad_(True)
    loss, m = policy_loss("sapo", leaf, old, adv, mask)
    (grad,) = torch.autograd.grad(loss.sum(), leaf)
    # d loss / d logp = -A * 4 p (1 - p) * r, p = sigmoid(tau (r - 1))
    for row, (a, tau) in enumerate(((2.0, 1.0), (-1.0, 1.05))):
        for col in range(3):
            r = ratios[row, col].item()
            p = torch.sigmoid(torch.tensor(tau * (r - 1.0), dtype=torch.float64)).item()
            assert grad[row, col].item() == pytest.approx(-a * 4 * p * (1 - p) * r, rel=1e-5)
    assert grad[0, 0].item() == pytest.approx(-2.0, rel=1e-6)  # r = 1: exactly -A, the policy gradient
    weight = (grad / (-adv[:, None] * ratios)).abs()  # the gate's gradient weight 4 p (1 - p)
    assert weight[0, 2] < weight[0, 1] < weight[0, 0] == pytest.approx(1.0)  # decays off-policy
    assert 0 < m["sapo_gate_mean"].item() < 1


@pytest.mark.parametrize("name,options,reference", CASES[1:2] + CASES[3:], ids=["cispo-2sided", "sapo-hot"])
def test_options_reach_the_loss_through_grpo_config(name, options, reference):
    fields = {"ratio_max": "cispo_ratio_max", "ratio_min": "cispo_ratio_min", "temperature_pos": "sapo_temperature_pos",
              "temperature_neg": "sapo_temperature_neg"}
    config = GRPOConfig(policy_loss=name, **{fields[k]: v for k, v in options.items()})
    assert config.policy_loss_options() == {**options, "log_ratio_clamp": 20.0} | (
        {"ratio_min": None} if name == "cispo" and "ratio_min" not in options else {})


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="cispo_ratio_min"):
        GRPOConfig(policy_loss="cispo", cispo_ratio_min=6.0)
    with pytest.raises(ValueError, match="sapo_temperature_neg"):
        GRPOConfig(policy_loss="sapo", sapo_temperature_neg=0.0)
    with pytest.raises(ValueError, match="ratio_min"):
        policy_loss("cispo", torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2, dtype=torch.bool),
                    ratio_min=2.0, ratio_max=1.5)


# ---------------------------------------------------------------------- TRL 1.16
TRL_CASES = [
    ("cispo", dict(epsilon_high=5.0), dict(cispo_ratio_max=5.0), "token-mean"),
    ("cispo", dict(epsilon_high=1.3), dict(cispo_ratio_max=1.3), "token-mean"),
    ("sapo", dict(), dict(), "seq-mean-token-mean"),
    ("sapo", dict(sapo_temperature_pos=3.0, sapo_temperature_neg=6.0),
     dict(sapo_temperature_pos=3.0, sapo_temperature_neg=6.0), "seq-mean-token-mean"),
]


@pytest.mark.parametrize("name,trl_options,ours,agg", TRL_CASES, ids=["cispo", "cispo-tight", "sapo", "sapo-hot"])
def test_matches_trl_on_identical_inputs(name, trl_options, ours, agg):
    from tests.core.trl_loss import trl_loss

    logp64, old64, adv64, mask = _inputs(11, b=8, t=12)
    logp32, old32, adv32 = logp64.float(), old64.float(), adv64.float()
    mask[0, 0] = True  # TRL divides by mask.sum(-1) in a metric: no empty row on its side
    theirs_leaf = logp32.clone().requires_grad_(True)
    theirs = trl_loss(name, theirs_leaf, old32, adv32, mask, **trl_options)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_leaf)

    config = GRPOConfig(policy_loss=name, loss_agg_mode=agg, mismatch_mode=None, **ours)
    leaf = logp32.clone().requires_grad_(True)
    loss, _ = compute_loss(leaf, old32, adv32, mask, config=config)
    (grad,) = torch.autograd.grad(loss, leaf)
    n = int(mask.sum())
    scale = 4.0 * float(adv64.abs().max()) * 5.0
    assert_close(loss, theirs, fp32_result(scale), f"{name} loss vs TRL")
    assert_close(grad, theirs_grad, fp32_result(scale / n * mask.shape[1]), f"{name} gradient vs TRL")
    # ... and both agree with the float64 paper formula, aggregated the same way.
    per_token = (_cispo64(logp64, old64, adv64, mask, ours.get("cispo_ratio_max", 5.0)) if name == "cispo" else
                 _sapo64(logp64, old64, adv64, mask, ours.get("sapo_temperature_pos", 1.0),
                         ours.get("sapo_temperature_neg", 1.05)))
    assert_close(loss, aggregate_loss(per_token, mask, mode=agg), fp32_result(scale), f"{name} loss vs float64")
