"""The parity harness's own memory: the float64 reference and the error measurement work a
chunk at a time, and chunking changes no number.

Why: measured whole, a hardware-sized gradient (4,096 x 152,064) took about seven float64
copies of itself on the host, 35 GB per test, and the hardware tests run in several pytest
workers at once on a 128 GiB host.
"""

from __future__ import annotations

import math

import pytest
import torch

from portarl.parity import errors, float64
from portarl.parity.tolerances import Tolerance, fp32_result
from test_memory_contract import AllocationLog


def _measure_whole(actual, expected, tol):
    """The unchunked formula: the numbers chunking must reproduce."""
    a = actual.detach().double().reshape(-1)
    e = expected.detach().double().reshape(-1)
    finite = torch.isfinite(e)
    same = (torch.isnan(a) & torch.isnan(e)) | (a == e)
    mismatches = int((~finite & ~same).sum()) + int((finite & ~torch.isfinite(a)).sum())
    both = finite & torch.isfinite(a)
    if not bool(both.any()):
        return 0.0, 0.0, 0.0, mismatches
    err = (a[both] - e[both]).abs()
    allowed = tol.allowed(e[both])
    ratio = torch.where(allowed > 0, err / allowed, torch.where(err > 0, math.inf, 0.0))
    scale = float(e[both].abs().max())
    max_abs = float(err.max())
    return max_abs, (max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)), float(ratio.max()), mismatches


def _inputs(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    expected = 5 * torch.randn(n, dtype=torch.float64, generator=gen)
    actual = (expected + 1e-3 * torch.randn(n, dtype=torch.float64, generator=gen)).float()
    expected[3], actual[3] = math.nan, math.nan  # agree on nan
    expected[50], actual[50] = math.inf, 1.0  # disagree: a mismatch
    expected[77], actual[77] = 0.0, math.nan  # a finite reference, a nan result: a mismatch
    actual[n - 2] = expected[n - 2] + 0.5  # the worst error, in the last chunk
    return actual, expected


@pytest.mark.parametrize("tol", [fp32_result(6.0), Tolerance(atol=0.0, rtol=1e-3), Tolerance(atol=0.0, rtol=0.0)],
                         ids=["atol", "rtol", "zero"])
def test_chunked_measure_equals_the_whole_one(monkeypatch, tol):
    monkeypatch.setattr(errors, "MEASURE_CHUNK_ELEMENTS", 64)
    actual, expected = _inputs(1000, seed=0)
    got = errors.measure(actual, expected, tol)
    assert (got.max_abs, got.max_rel, got.worst_ratio, got.nonfinite_mismatches) == _measure_whole(actual, expected, tol)
    assert got.nonfinite_mismatches == 2 and got.max_abs == pytest.approx(0.5, rel=1e-6)


def test_a_chunk_with_nothing_finite_changes_nothing(monkeypatch):
    monkeypatch.setattr(errors, "MEASURE_CHUNK_ELEMENTS", 8)
    actual, expected = _inputs(100, seed=1)
    actual[:8], expected[:8] = math.nan, math.nan  # the first chunk: nan on both sides
    assert errors.measure(actual, expected, fp32_result(1.0)).max_abs == _measure_whole(actual, expected, fp32_result(1.0))[0]
    nothing = torch.full((20,), math.nan)
    got = errors.measure(nothing, nothing.double(), fp32_result(1.0))
    assert (got.max_abs, got.max_rel, got.worst_ratio, got.nonfinite_mismatches, got.passed) == (0.0, 0.0, 0.0, 0, True)


def test_measure_holds_one_chunk_in_float64_at_a_time(monkeypatch):
    monkeypatch.setattr(errors, "MEASURE_CHUNK_ELEMENTS", 1000)
    actual, expected = _inputs(20_000, seed=2)
    log = AllocationLog()
    with log:
        errors.measure(actual, expected, fp32_result(6.0))
    assert max(n for _, n in log.sizes) <= 1000, "measure allocated beyond one chunk"


def test_reference_fills_its_outputs_in_place_and_chunking_changes_nothing(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(2, 37, 301, generator=gen)
    labels = torch.randint(0, 301, (2, 37), generator=gen)
    labels[0, 5] = -100
    g1, g2 = torch.randn(2, 37, generator=gen), torch.randn(2, 37, generator=gen)
    whole = float64.logprobs_float64(logits, labels, temperature=0.7, grad_logp=g1, grad_entropy=g2)
    monkeypatch.setattr(float64, "_CHUNK_ELEMENTS", 301 * 5)  # 5 rows a chunk: 15 chunks, the last short
    log = AllocationLog()
    with log:
        chunked = float64.logprobs_float64(logits, labels, temperature=0.7, grad_logp=g1, grad_entropy=g2)
    for key in ("logp", "entropy", "grad"):
        assert chunked[key].dtype == torch.float64 and torch.equal(chunked[key], whole[key]), key
    n_by_v = [n for _, n in log.sizes if n >= logits.numel()]
    assert n_by_v == [logits.numel()], f"one float64 N x V tensor (the gradient), got {n_by_v}"


def test_float64_references_run_on_a_gpu_and_beside_an_npu_on_the_host():
    """Ascend runs float64 slowly or not at all (shared notes: keep float64 on the CPU)."""
    assert float64.reference_device_for("cuda:1") == torch.device("cuda:1")
    assert float64.reference_device_for(torch.device("cpu")) == torch.device("cpu")
    assert float64.reference_device_for(torch.device("meta")) == torch.device("cpu")
