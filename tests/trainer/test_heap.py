"""portarl.trainer.memory.heap: freed heap memory goes back to the OS between a step's phases,
when enough of it is free to pay for the trim.

The probe frees every other block of a fragmented heap (so free() alone cannot shrink it:
only pages inside freed chunks can go back, which is what ``malloc_trim(0)`` does) and
checks the resident set before and after. Runs in a subprocess so the suite's own heap
does not blur the figure."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

PROBE = r"""
import os, sys
from portarl.trainer.memory.heap import free_heap_bytes, release_freed_memory

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

block = 64 * 1024  # below glibc's initial mmap threshold: these live in the heap
blocks = [b"\x01" * block for _ in range(3000)]  # ~188 MiB written
kept = blocks[1::2]
del blocks  # every other block freed: holes the heap top cannot give back
free = free_heap_bytes() / 2**20
before = rss_mib()
ran = release_freed_memory(int(sys.argv[1]) * 2**20)
after = rss_mib()
print(ran, before, after, free, len(kept))
"""

HOLES_MIB = 1500 * 64 / 1024  # freed by the probe


def probe(min_free_mib: int) -> tuple[bool, float, float, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(min_free_mib)], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", float(out[1]), float(out[2]), float(out[3])


glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or "libc.so" not in (ctypes.util.find_library("c") or ""),
    reason="malloc_trim and mallinfo2 are glibc's (Linux)")


@glibc_only
def test_freed_holes_go_back_to_the_os():
    ran, before, after, free = probe(min_free_mib=int(HOLES_MIB / 2))
    assert free >= HOLES_MIB  # mallinfo2 sees the holes
    assert ran
    assert before - after > 0.8 * HOLES_MIB, (before, after)


@glibc_only
def test_a_heap_with_little_free_is_left_alone():
    """Fewer free bytes than asked for: no trim, the pages stay (a trim would cost the next
    phase a page fault per page, for memory too small to matter)."""
    ran, before, after, free = probe(min_free_mib=int(HOLES_MIB * 4))
    assert HOLES_MIB <= free < HOLES_MIB * 4
    assert not ran
    assert before - after < 0.1 * HOLES_MIB, (before, after)


def test_without_glibc_it_is_a_no_op(monkeypatch):
    from portarl.trainer.memory import heap

    heap._glibc.cache_clear()
    monkeypatch.setattr(heap.ctypes.util, "find_library", lambda name: None)
    try:
        assert heap.release_freed_memory(0) is False
        assert heap.free_heap_bytes() is None
    finally:
        heap._glibc.cache_clear()


@glibc_only
def test_a_small_models_step_does_not_trim(make_trainer, monkeypatch):
    """The tiny model's step frees a few MiB between phases: no trim (each cost it page
    faults worth about a third of its CPU time). A threshold of 0 trims at every call:
    after the rollout, after scoring and after the micro-batch's backward."""
    from portarl.trainer.memory import heap

    libc = heap._glibc()
    calls = []
    monkeypatch.setattr(heap, "_glibc", lambda: libc._replace(malloc_trim=lambda pad: calls.append(pad) or 1))
    trainer = make_trainer("train.micro_batch_size=16")
    # Count only what this step leaves free: in a long test session the process's heap
    # already holds hundreds of MiB freed by earlier tests (a fresh training process does not).
    real_free, before = heap.free_heap_bytes, heap.free_heap_bytes()
    monkeypatch.setattr(heap, "free_heap_bytes", lambda: None if before is None else max(0, real_free() - before))
    trainer.train_step()
    assert calls == []
    monkeypatch.setattr(heap.release_freed_memory, "__defaults__", (0,))
    trainer.train_step()
    assert len(calls) == 3, calls


@pytest.mark.compares_runs
def test_gradients_first_gives_the_same_gradients_and_drops_untouched_ones():
    """The step's gradients exist (zeros) before the forward; the backward adds into them
    and gives bitwise the gradients autograd would have allocated itself; a parameter no
    backward reached is back to None (an optimizer skips it, as before)."""
    import torch

    import run_guard
    from portarl.trainer.memory.heap import GradientsFirst

    torch.manual_seed(0)
    used, unused = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    params = [*used.parameters(), *unused.parameters()]
    for micro_batches in (1, 2):
        want = []
        for p in params:
            p.grad = None
        for chunk in x.chunk(micro_batches):
            used(chunk).pow(2).sum().backward()
        want = [None if p.grad is None else p.grad.clone() for p in params]
        run_guard.assert_gradient_flows(want, what=f"autograd's own gradients ({micro_batches} micro-batches)")
        for p in params:
            p.grad = None
        grads = GradientsFirst(params)
        assert all(p.grad is not None and not p.grad.any() for p in params)
        for chunk in x.chunk(micro_batches):
            used(chunk).pow(2).sum().backward()
        grads.drop_untouched()
        for p, w in zip(params, want):
            assert (p.grad is None) == (w is None)
            if w is not None:
                assert torch.equal(p.grad, w)
        assert all(p.grad is None for p in unused.parameters())


def test_gradients_first_leaves_sharded_parameters_to_fsdp():
    import torch

    from portarl.trainer.memory.heap import GradientsFirst

    class Sharded(torch.nn.Parameter):  # stands in for FSDP2's DTensor parameters
        def full_tensor(self):
            return self

    p = Sharded(torch.ones(2))
    GradientsFirst([p]).drop_untouched()
    assert p.grad is None
