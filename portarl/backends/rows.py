"""Row addressing shared by the backends: any strided ``[..., V]`` view as N rows.

The memory contract forbids copying the logits into an N x V buffer, but the most common
input in RL is a strided slice such as ``logits[:, :-1]`` whose rows cannot be viewed as
one 2-D tensor. These helpers let backends read rows in place (element offsets for the
Triton kernels) or in bounded chunks (row gathers of at most ``chunk_rows`` rows).
"""

from __future__ import annotations

import os
from typing import Iterator

import torch

_DEFAULT_CHUNK_ELEMENTS = 1 << 24  # 16 Mi elements: 64 MiB of fp32 per temporary (accelerators)

#: Byte budget of one fp32 work buffer on a CPU. Measured on x86-64 (bench/results/
#: kernels-cpu-x86-64.md): 64 MiB temporaries exceed the L3 cache and glibc's mmap threshold,
#: so every temporary is a fresh page-faulting mmap; 4 MiB buffers stay in cache and are
#: reused chunk after chunk, which made the reference backend 4-8x faster.
CPU_CHUNK_BYTES = 4 << 20


def chunk_elements(default: int | None = None) -> int:
    """Largest temporary (in elements) a chunked backend may allocate per step.

    ``PORTARL_CHUNK_ELEMENTS`` overrides the backend's ``default`` (2**24 when not given:
    the accelerator budget; the CPU reference passes :func:`cpu_chunk_elements`'s).
    """
    raw = os.environ.get("PORTARL_CHUNK_ELEMENTS")
    if raw is None:
        return _DEFAULT_CHUNK_ELEMENTS if default is None else default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"PORTARL_CHUNK_ELEMENTS={raw!r} must be a positive integer")
    return value


def cpu_chunk_elements() -> int:
    """The CPU budget in fp32 elements (:data:`CPU_CHUNK_BYTES`); the env override still wins."""
    return chunk_elements(default=CPU_CHUNK_BYTES // 4)


def chunk_rows(n_cols: int, max_rows: int | None = None, *, elements: int | None = None) -> int:
    """Rows per chunk so that a chunk holds at most ``elements`` (default :func:`chunk_elements`)."""
    rows = max(1, (chunk_elements() if elements is None else elements) // max(1, n_cols))
    return rows if max_rows is None else min(rows, max_rows)


def row_offsets(logits: torch.Tensor) -> torch.Tensor:
    """int64 [N]: element offset of each row's first entry from ``logits.data_ptr()``."""
    offsets = torch.zeros((), dtype=torch.int64, device=logits.device)
    for size, stride in zip(logits.shape[:-1], logits.stride()[:-1]):
        step = torch.arange(size, dtype=torch.int64, device=logits.device) * stride
        offsets = offsets.unsqueeze(-1) + step
    return offsets.reshape(-1)


def iter_row_chunks(logits: torch.Tensor, rows_per_chunk: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(start, stop, rows)`` with ``rows`` a [stop - start, V] tensor.

    A view of the input when its rows can be viewed as 2-D, else a gather of just those rows.
    """
    n_cols = logits.shape[-1]
    n_rows = logits.numel() // n_cols if n_cols else 0
    lead = logits.shape[:-1]
    try:
        flat = logits.view(n_rows, n_cols)
    except RuntimeError:
        flat = None
    for start in range(0, n_rows, rows_per_chunk):
        stop = min(n_rows, start + rows_per_chunk)
        if flat is not None:
            yield start, stop, flat[start:stop]
        else:
            index = torch.unravel_index(torch.arange(start, stop, device=logits.device), lead)
            yield start, stop, logits[index]
