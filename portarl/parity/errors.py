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


def measure(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> Errors:
    where = reference_device()  # the CPU, unless the sweep runs its references on the device
    a = actual.detach().to(where, torch.float64).reshape(-1)
    e = expected.detach().to(where, torch.float64).reshape(-1)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs reference {tuple(expected.shape)}")
    finite = torch.isfinite(e)
    same_nonfinite = (torch.isnan(a) & torch.isnan(e)) | (a == e)
    mismatches = int((~finite & ~same_nonfinite).sum()) + int((finite & ~torch.isfinite(a)).sum())
    both = finite & torch.isfinite(a)
    if bool(both.any()):
        err = (a[both] - e[both]).abs()
        max_abs = float(err.max())
        scale = float(e[both].abs().max())
        max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
        allowed = tol.allowed(e[both])
        ratio = torch.where(allowed > 0, err / allowed, torch.where(err > 0, math.inf, 0.0))
        worst = float(ratio.max())
    else:
        max_abs = max_rel = worst = 0.0
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
