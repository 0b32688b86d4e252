"""portarl.trainer.heap: freed heap memory goes back to the OS between a step's phases.

The test frees every other block of a fragmented heap (so free() alone cannot shrink it:
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
import os
from portarl.trainer.heap import release_freed_memory

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

block = 64 * 1024  # below glibc's initial mmap threshold: these live in the heap
blocks = [b"\x01" * block for _ in range(6000)]  # ~375 MiB written
kept = blocks[1::2]
del blocks  # every other block freed: holes the heap top cannot give back
before = rss_mib()
ran = release_freed_memory()
after = rss_mib()
print(ran, before, after, len(kept))
"""


@pytest.mark.skipif(platform.system() != "Linux" or "libc.so" not in (ctypes.util.find_library("c") or ""),
                    reason="malloc_trim is glibc's (Linux)")
def test_freed_holes_go_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    ran, before, after = out[0] == "True", float(out[1]), float(out[2])
    assert ran
    freed = 3000 * 64 / 1024  # MiB in the holes
    assert before - after > 0.8 * freed, (before, after)


def test_without_glibc_it_is_a_no_op(monkeypatch):
    from portarl.trainer import heap

    heap._malloc_trim.cache_clear()
    monkeypatch.setattr(heap.ctypes.util, "find_library", lambda name: None)
    try:
        assert heap.release_freed_memory() is False
    finally:
        heap._malloc_trim.cache_clear()
