"""ops.logprobs forward and backward against float64, every target x dtype x seeded case.

The cases (portarl.parity.cases) cover V in {1, 17, 4099, 32000, 152064}, N from 1 to
4096, leading batch dims, a strided slice and a transposed layout, rows all ignored,
logits of magnitude 1e4, -inf entries and temperature 0.7. Each is checked through the
same runner the ``portarl parity`` CLI uses, so the suite and the reports cannot drift.
"""

from __future__ import annotations

import pytest
import torch

from portarl import ops
from portarl.parity import cases as case_lib
from portarl.parity.errors import assert_close
from portarl.parity.float64 import computed_on, logprobs_float64, reference_device_for
from portarl.parity.sweep import run_logprobs_case
from portarl.parity.tolerances import fp32_result, stored_gradient

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASES = case_lib.standard_logprobs_cases()


def _assert_records_pass(records):
    failed = [r for r in records if not r.passed]
    assert not failed, "\n".join(
        f"{r.case} {r.dtype} {r.quantity}: "
        + (r.error or f"max_abs={r.max_abs:.3e} is {r.worst_ratio:.2f}x tolerance (atol={r.atol:.2e} rtol={r.rtol:.2e}), "
           f"{r.nonfinite_mismatches} nan/inf mismatches")
        for r in failed
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: case_lib.DTYPE_NAMES[d])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_logprobs_matches_float64(target, case, dtype):
    if target.id == "cuda-interpreted" and not case.fits_interpreter():
        pytest.skip(f"{case.name} is too large for the Triton interpreter; it runs on hardware (cuda-gpu)")
    records = run_logprobs_case(case, target.backend, dtype, torch.device(target.device), repeats=0)
    assert {r.quantity for r in records} == {"logp", "entropy", "grad"}
    assert all(r.backend == target.backend for r in records)
    _assert_records_pass(records)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: case_lib.DTYPE_NAMES[d])
def test_gradient_through_one_output_only(target, dtype):
    """logp alone (no entropy requested) and entropy alone (logp unused) both differentiate."""
    case = case_lib.LogprobsCase("one_output", lead=(2, 9), vocab=131, temperature=0.7, seed=31)
    logits, labels = case.make(dtype, target.device)
    scale = case.input_scale()
    g = torch.randn(labels.shape, generator=torch.Generator().manual_seed(5))

    leaf = logits.detach().requires_grad_(True)
    logp = ops.logprobs(leaf, labels, temperature=0.7, backend=target.backend)
    logp.backward(g.to(target.device))
    ref = logprobs_float64(logits, labels, temperature=0.7, grad_logp=g)
    assert logp.dtype == torch.float32 and leaf.grad.dtype == dtype
    assert_close(logp, ref["logp"], fp32_result(scale), "logp")
    assert_close(leaf.grad, ref["grad"], stored_gradient(scale, float(g.abs().max()) / 0.7, dtype), "grad via logp")

    leaf = logits.detach().requires_grad_(True)
    _, entropy = ops.logprobs(leaf, labels, temperature=0.7, return_entropy=True, backend=target.backend)
    entropy.backward(g.to(target.device))
    ref = logprobs_float64(logits, labels, temperature=0.7, grad_entropy=g)
    assert_close(entropy, ref["entropy"], fp32_result(scale), "entropy")
    assert_close(leaf.grad, ref["grad"], stored_gradient(scale, float(g.abs().max()) / 0.7, dtype), "grad via entropy")


def test_results_name_their_backend(target):
    logits = torch.randn(3, 11, device=target.device)
    labels = torch.tensor([0, 5, -100], device=target.device)
    logp, entropy = ops.logprobs(logits, labels, return_entropy=True, backend=target.backend)
    assert ops.computed_by(logp) == target.backend
    assert ops.computed_by(entropy) == target.backend


def test_ignored_positions_are_zero_with_zero_gradient(target):
    logits = torch.randn(4, 50, device=target.device).requires_grad_(True)
    labels = torch.tensor([3, -100, 7, -100], device=target.device)
    logp, entropy = ops.logprobs(logits, labels, return_entropy=True, backend=target.backend)
    (logp.sum() + entropy.sum()).backward()
    assert logp[1].item() == 0.0 and logp[3].item() == 0.0
    assert entropy[1].item() == 0.0 and entropy[3].item() == 0.0
    assert torch.count_nonzero(logits.grad[1]) == 0 and torch.count_nonzero(logits.grad[3]) == 0
    assert torch.count_nonzero(logits.grad[0]) > 0


def test_custom_ignore_index(target):
    logits = torch.randn(3, 20, device=target.device)
    labels = torch.tensor([19, 0, 4], device=target.device)
    logp = ops.logprobs(logits, labels, ignore_index=0, backend=target.backend)
    assert logp[1].item() == 0.0 and logp[0].item() < 0.0


def test_no_rows(target):
    logits = torch.randn(0, 7, device=target.device, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.int64, device=target.device)
    logp, entropy = ops.logprobs(logits, labels, return_entropy=True, backend=target.backend)
    assert logp.shape == (0,) and entropy.shape == (0,) and logp.dtype == torch.float32
    logp.sum().backward()
    assert logits.grad.shape == (0, 7)


#: hardware_sized: hardware-check runs these one after another in a process of their own
#: (portarl.bench.hardware.tests_stage): each holds GBs on the host and the device, and several
#: at once ran out of memory in the H200 loan's 8- and 14-worker runs. Dtype varies fastest,
#: so a case's host draws (600 M values) are made once for its three dtypes.
@pytest.mark.hardware_sized
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: case_lib.DTYPE_NAMES[d])
@pytest.mark.parametrize("case", case_lib.hardware_logprobs_cases(), ids=lambda c: c.name)
def test_logprobs_large_shapes_on_hardware(hardware_target, case, dtype):
    device = torch.device(hardware_target.device)
    with computed_on(reference_device_for(device)):  # as the hardware-check's parity stage does
        records = run_logprobs_case(case, hardware_target.backend, dtype, device, repeats=0)
    _assert_records_pass(records)
