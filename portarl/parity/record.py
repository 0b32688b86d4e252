"""One parity measurement (:class:`Record`) and how a sweep takes it: time an op on its
device (:func:`timed`), hold its output to the float64 reference and keep a fixed sample of
its values (:func:`fill`). Shared by :mod:`portarl.parity.sweep` and
:mod:`portarl.parity.linear_sweep`."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from portarl.parity.errors import measure
from portarl.parity.tolerances import Tolerance

#: Output positions per quantity kept in a report for cross-device comparison.
SAMPLES_PER_QUANTITY = 32


@dataclasses.dataclass
class Record:
    op: str
    case: str
    backend: str
    dtype: str
    quantity: str
    max_abs: float | None = None
    max_rel: float | None = None
    worst_ratio: float | None = None
    nonfinite_mismatches: int | None = None
    atol: float | None = None
    rtol: float | None = None
    passed: bool = False
    forward_ms: float | None = None
    backward_ms: float | None = None
    sample_index: list[int] = dataclasses.field(default_factory=list)
    sample_values: list[float | str] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What identifies the same measurement on another device (backend excluded)."""
        return (self.op, self.case, self.dtype, self.quantity)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        from portarl.backends.npu import torch_npu_api

        torch_npu_api.synchronize()


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[object, float]:
    """Result of the last call and its wall time (ms): the median of ``repeats`` calls after
    a warm-up call, or the warm-up call itself when ``repeats`` is 0."""
    times = []
    for _ in range(1 + repeats):
        synchronize(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    timed = sorted(times[1:] or times)
    return result, timed[len(timed) // 2]


def _sample_index(numel: int, seed: int) -> torch.Tensor:
    if numel <= SAMPLES_PER_QUANTITY:
        return torch.arange(numel)
    gen = torch.Generator().manual_seed(seed)
    if numel > 1 << 24:  # hardware-sized: a permutation of 600 M positions is 5 GB of int64
        drawn = torch.randint(0, numel, (4 * SAMPLES_PER_QUANTITY,), generator=gen).unique()  # sorted
        keep = torch.randperm(drawn.numel(), generator=gen)[:SAMPLES_PER_QUANTITY]
        return drawn[keep].sort().values
    return torch.randperm(numel, generator=gen)[:SAMPLES_PER_QUANTITY].sort().values


def _json_number(x: float) -> float | str:
    return x if x == x and abs(x) != float("inf") else str(x)


def fill(record: Record, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, seed: int) -> Record:
    err = measure(actual, expected, tol)
    record.max_abs, record.max_rel, record.worst_ratio = err.max_abs, err.max_rel, err.worst_ratio
    record.nonfinite_mismatches, record.atol, record.rtol = err.nonfinite_mismatches, tol.atol, tol.rtol
    record.passed = err.passed
    flat = actual.detach().reshape(-1)
    index = _sample_index(flat.numel(), seed)
    record.sample_index = index.tolist()
    picked = flat[index.to(flat.device)].to("cpu", torch.float64)  # the sample alone crosses to the host
    record.sample_values = [_json_number(v) for v in picked.tolist()]
    return record
