"""Handing freed host memory back to the operating system between a step's phases.

glibc's malloc keeps what a phase frees in its heap for reuse, and raises its mmap
threshold as large blocks come and go, so the rollout's freed KV caches, the scoring
forwards' chunks and each micro-batch's activations stay resident while the next phase
allocates. ``malloc_trim(0)`` returns the free pages of every arena (glibc >= 2.8 releases
whole free pages inside the heap, not only its top). Called after the rollout, after
scoring and after each micro-batch's backward it costs milliseconds and changes no number;
on CPU, one SmolLM2-135M step at the README settings with glibc's defaults peaked at
6.50 GiB without it, 5.81 GiB with the phase calls and 4.72 GiB with the micro-batch calls
too (bench/results/step-cpu-vs-trl-smollm2-glibc.md, step-cpu-smollm2-glibc-trimmed*.md).
On other C libraries it is absent and this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_freed_memory() -> bool:
    """Give the C heap's free pages back to the OS; True when glibc's ``malloc_trim`` ran."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
