"""Measure a result against its float64 reference under a :class:`Tolerance`."""

from __future__ import annotations

import dataclasses
import math

import torch

from portarl.parity.float64 import reference_device
from portarl.parity.tolerances import Tolerance


@dataclasses.dataclass(frozen=True)
class Errors:
    max_abs: float  # over positions where the reference is finite
    max_rel: float  # max_abs / max |reference| (normwise, so near-zero values do not blow up)
    worst_ratio: float  # max of |error| / allowed: <= 1 passes
    nonfinite_mismatches: int  # positions where actual and reference disagree on nan/inf
    atol: float
    rtol: float

    @property
    def passed(self) -> bool:
        return self.nonfinite_mismatches == 0 and self.worst_ratio <= 1.0


#: Elements measured at a time: a hardware-sized gradient (4,096 x 152,064) is 5 GB in
#: float64, and measuring it whole took about seven such copies (35 GB of host memory per
#: test; several pytest workers at once ran a 128 GiB host out of memory). Chunking changes
#: no number: every figure is a maximum or a count.
MEASURE_CHUNK_ELEMENTS = 1 << 24


def measure(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> Errors:
    """Errors of ``actual`` against the float64 ``expected`` (same number of elements), on
    :func:`reference_device`, in chunks of :data:`MEASURE_CHUNK_ELEMENTS`: at most one
    chunk of each is in float64 at a time."""
    where = reference_device()  # the CPU, unless the sweep runs its references on the device
    a_all = actual.detach().reshape(-1)
    e_all = expected.detach().reshape(-1)
    if a_all.shape != e_all.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs reference {tuple(expected.shape)}")
    mismatches = 0
    max_abs = scale = worst = 0.0
    for start in range(0, a_all.numel(), MEASURE_CHUNK_ELEMENTS):
        a = a_all[start : start + MEASURE_CHUNK_ELEMENTS].to(where, torch.float64)
        e = e_all[start : start + MEASURE_CHUNK_ELEMENTS].to(where, torch.float64)
        finite = torch.isfinite(e)
        same_nonfinite = (torch.isnan(a) & torch.isnan(e)) | (a == e)
        mismatches += int((~finite & ~same_nonfinite).sum()) + int((finite & ~torch.isfinite(a)).sum())
        both = finite & torch.isfinite(a)
        if not bool(both.any()):
            continue
        e = e[both]
        err = (a[both] - e).abs()
        allowed = tol.allowed(e)
        ratio = torch.where(allowed > 0, err / allowed, torch.where(err > 0, math.inf, 0.0))
        max_abs = max(max_abs, float(err.max()))
        scale = max(scale, float(e.abs().max()))
        worst = max(worst, float(ratio.max()))
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return Errors(max_abs, max_rel, worst, mismatches, tol.atol, tol.rtol)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str) -> Errors:
    """Test helper: raise AssertionError describing the worst error when ``actual`` fails."""
    errors = measure(actual, expected, tol)
    if not errors.passed:
        raise AssertionError(
            f"{what}: max abs error {errors.max_abs:.3e} (max rel {errors.max_rel:.3e}) is "
            f"{errors.worst_ratio:.2f}x the tolerance atol={tol.atol:.3e} rtol={tol.rtol:.3e}; "
            f"{errors.nonfinite_mismatches} nan/inf mismatches"
        )
    return errors
