"""ops.kl forward and backward against float64: every target x dtype x case x estimator,
plus the clamps as arguments and masking that holds even over NaN/inf."""

from __future__ import annotations

import math

import pytest
import torch

from portarl import ops
from portarl.parity import cases as case_lib
from portarl.parity.errors import assert_close
from portarl.parity.float64 import kl_float64
from portarl.parity.sweep import run_kl_case
from portarl.parity.tolerances import fp32_result, stored_gradient

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("estimator", ops.KL_ESTIMATORS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: case_lib.DTYPE_NAMES[d])
@pytest.mark.parametrize("case", case_lib.standard_kl_cases(), ids=lambda c: c.name)
def test_kl_matches_float64(target, case, dtype, estimator):
    records = run_kl_case(case, estimator, target.backend, dtype, torch.device(target.device), repeats=0)
    failed = [r for r in records if not r.passed]
    assert not failed, [(r.quantity, r.error, r.max_abs, r.worst_ratio) for r in failed]


def test_estimator_formulas_on_known_values(target):
    """k1 = -d, k2 = d^2/2, k3 = exp(d) - d - 1 at hand-checked points (d = ref - logp)."""
    logp = torch.tensor([-1.0, -2.0, -0.5], device=target.device)
    ref = torch.tensor([-1.0, -1.0, -1.5], device=target.device)  # d = 0, 1, -1
    k1 = ops.kl(logp, ref, estimator="k1", backend=target.backend)
    k2 = ops.kl(logp, ref, estimator="k2", backend=target.backend)
    k3 = ops.kl(logp, ref, estimator="k3", backend=target.backend)
    torch.testing.assert_close(k1.cpu(), torch.tensor([0.0, -1.0, 1.0]))
    torch.testing.assert_close(k2.cpu(), torch.tensor([0.0, 0.5, 0.5]))
    torch.testing.assert_close(k3.cpu(), torch.tensor([0.0, math.e - 2.0, math.exp(-1.0)]))
    assert k3.dtype == torch.float32 and ops.computed_by(k3) == target.backend


@pytest.mark.parametrize("log_ratio_clamp,max_value", [(None, None), (5.0, None), (None, 3.0), (2.0, 1.5)])
def test_k3_clamps_are_arguments(target, log_ratio_clamp, max_value):
    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(200, generator=gen) * 3
    ref = logp + torch.linspace(-8, 8, 200)
    g = torch.randn(200, generator=gen)
    a = logp.to(target.device).requires_grad_(True)
    b = ref.to(target.device).requires_grad_(True)
    value = ops.kl(a, b, estimator="k3", log_ratio_clamp=log_ratio_clamp, max_value=max_value, backend=target.backend)
    value.backward(g.to(target.device))
    expected = kl_float64(logp, ref, estimator="k3", log_ratio_clamp=log_ratio_clamp, max_value=max_value, grad_out=g)
    size = math.exp(8.0) if log_ratio_clamp is None and max_value is None else 11.0 + math.exp(log_ratio_clamp or 0)
    assert_close(value, expected["value"], fp32_result(size), "k3 value")
    assert_close(a.grad, expected["grad_logp"], stored_gradient(size, float(g.abs().max()), torch.float32), "grad logp")
    assert_close(b.grad, expected["grad_ref"], stored_gradient(size, float(g.abs().max()), torch.float32), "grad ref")
    if max_value is not None:
        assert float(value.detach().max()) <= max_value
    if log_ratio_clamp is not None and max_value is None:
        assert float(value.detach().max()) == pytest.approx(math.exp(log_ratio_clamp) - log_ratio_clamp - 1, rel=1e-6)


def test_masked_positions_are_zero_even_over_nan(target):
    logp = torch.tensor([-1.0, float("nan"), -2.0, float("-inf")], device=target.device, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, float("inf"), -1.0], device=target.device, requires_grad=True)
    mask = torch.tensor([True, False, False, False], device=target.device)
    for estimator in ops.KL_ESTIMATORS:
        value = ops.kl(logp, ref, estimator=estimator, mask=mask, backend=target.backend)
        assert torch.equal(value[1:].cpu(), torch.zeros(3)), estimator
        (ga, gb) = torch.autograd.grad(value.sum(), (logp, ref))
        assert torch.equal(ga[1:].cpu(), torch.zeros(3)) and torch.equal(gb[1:].cpu(), torch.zeros(3)), estimator
        assert torch.isfinite(ga[0]) and ga[0] != 0


def test_numeric_mask_means_nonzero_keeps(target):
    logp = torch.tensor([-1.0, -2.0, -3.0], device=target.device)
    ref = torch.tensor([-2.0, -2.5, -1.0], device=target.device)
    bool_mask = torch.tensor([True, False, True], device=target.device)
    float_mask = torch.tensor([1.0, 0.0, 0.5], device=target.device)
    a = ops.kl(logp, ref, mask=bool_mask, backend=target.backend)
    b = ops.kl(logp, ref, mask=float_mask, backend=target.backend)
    assert torch.equal(a, b)


def test_nan_unmasked_gives_nan_and_ref_neg_inf_is_capped(target):
    logp = torch.tensor([float("nan"), -1.0], device=target.device)
    ref = torch.tensor([-1.0, float("-inf")], device=target.device)
    k3 = ops.kl(logp, ref, estimator="k3", backend=target.backend)
    assert math.isnan(k3[0].item())
    assert k3[1].item() == 10.0  # d = -inf clamped to -20: exp(-20) + 19 > 10, capped
    k1 = ops.kl(logp, ref, estimator="k1", backend=target.backend)
    assert k1[1].item() == math.inf


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: case_lib.DTYPE_NAMES[d])
@pytest.mark.parametrize("estimator", ops.KL_ESTIMATORS)
def test_kl_large_on_hardware(hardware_target, dtype, estimator):
    for case in case_lib.hardware_kl_cases():
        records = run_kl_case(case, estimator, hardware_target.backend, dtype, torch.device(hardware_target.device), repeats=0)
        assert all(r.passed for r in records), [(r.quantity, r.error, r.worst_ratio) for r in records]
