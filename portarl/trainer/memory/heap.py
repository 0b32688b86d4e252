"""Handing freed host memory back to the operating system between a step's phases, when
that pays for itself.

glibc's malloc keeps what a phase frees in its heap for reuse, and raises its mmap
threshold as large blocks come and go, so the rollout's freed KV caches, the scoring
forwards' chunks and each micro-batch's activations stay resident while the next phase
allocates. ``malloc_trim(0)`` returns the free pages of every arena (glibc >= 2.8 releases
whole free pages inside the heap, not only its top). On CPU, one SmolLM2-135M step at the
README settings with glibc's defaults peaked at 6.50 GiB without it, 5.81 GiB with calls
after the rollout and after scoring and 4.72 GiB with a call after each micro-batch's
backward too (bench/results/step-cpu-vs-trl-smollm2-glibc.md, step-cpu-smollm2-glibc-trimmed*.md):
at those calls 1-4 GiB of the heap were free.

A trim is not free, though: every page it hands back that the next phase uses again is
faulted in and zeroed once more. On the tiny model's step (8 x 8 samples, a few MiB of
activations) only 12-17 MiB were ever free at those calls, and giving them back cost about
a third of the step's CPU time. So :func:`release_freed_memory` asks glibc first
(``mallinfo2``: free bytes over every arena, tens to hundreds of microseconds) and trims
only when at least :data:`TRIM_MIN_FREE_BYTES` are free: the resident set then stays at
most that far above the live tensors at each call, and a trim is made only where it returns
enough memory to matter. Without ``mallinfo2`` (glibc < 2.33) every call trims, as before;
on other C libraries (musl, macOS) this is a no-op. No number changes either way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import typing

import torch

#: Trim only when glibc's arenas hold at least this much free memory (256 MiB): far above a
#: small model's step (12-17 MiB free, where a trim cost a third of the step), far below a
#: 135M-parameter model's (1-4 GiB free at the same calls).
TRIM_MIN_FREE_BYTES = 256 * 2**20


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (``malloc.h``, glibc >= 2.33): every field a ``size_t``."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class _Glibc(typing.NamedTuple):
    malloc_trim: typing.Callable
    mallinfo2: typing.Callable | None  # None before glibc 2.33


@functools.lru_cache(maxsize=1)
def _glibc() -> _Glibc | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    info = getattr(libc, "mallinfo2", None)
    if info is not None:
        info.argtypes, info.restype = [], _MallInfo2
    return _Glibc(trim, info)


def free_heap_bytes() -> int | None:
    """Bytes free inside glibc's arenas (``mallinfo2().fordblks``, summed over every arena),
    or None where glibc's ``mallinfo2`` is not available."""
    libc = _glibc()
    if libc is None or libc.mallinfo2 is None:
        return None
    return int(libc.mallinfo2().fordblks)


def release_freed_memory(min_free_bytes: int = TRIM_MIN_FREE_BYTES) -> bool:
    """Give the C heap's free pages back to the OS when at least ``min_free_bytes`` of it are
    free (see the module docstring); True when glibc's ``malloc_trim`` ran."""
    libc = _glibc()
    if libc is None:
        return False
    free = free_heap_bytes()
    if free is not None and free < min_free_bytes:
        return False
    libc.malloc_trim(0)
    return True


class GradientsFirst:
    """An optimizer step's gradients allocated before its first forward, as zeros.

    Left to autograd, each parameter's gradient is allocated during the first micro-batch's
    backward, in an order that depends on the engine's ready queue, between the blocks of
    that backward's activations: the step's longest-lived blocks then pin freed activation
    memory inside the heap and the resident set grows past what the tensors need (and
    varies from run to run with the address layout: a SmolLM2-shaped 8-layer step at the
    README settings peaked 1.73-1.96 GiB over five identical runs). Allocated first, they
    sit below everything the micro-batches allocate (1.49-1.58 GiB on the same runs).

    Autograd then adds into them in place: 0 + g = g, the same numbers (a zero gradient's
    sign aside, which no update sees). A gradient no backward touched (its version counter
    unchanged) is set back to None by :meth:`drop_untouched`, so an optimizer still skips a
    parameter that got no gradient. Off for FSDP2's sharded parameters (DTensors), whose
    gradients FSDP2 allocates and reduces itself.
    """

    def __init__(self, params: list):
        self.params = [] if any(hasattr(p, "full_tensor") for p in params) else [
            p for p in params if p.grad is None]
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.versions = [p.grad._version for p in self.params]

    def drop_untouched(self) -> None:
        """After the step's last backward: gradients nothing accumulated into go back to None."""
        for p, version in zip(self.params, self.versions):
            if p.grad is not None and p.grad._version == version:
                p.grad = None
