"""Device and shapes of the pytest-benchmark files (see conftest.py)."""

from __future__ import annotations

import os

import torch

from portarl.bench import kernels


def bench_device() -> torch.device:
    from portarl.backends.device import resolve_device

    return resolve_device(os.environ.get("PORTARL_BENCH_DEVICE", "auto"))


def bench_shapes() -> list[tuple[int, int]]:
    if os.environ.get("PORTARL_BENCH_QUICK") == "1":
        return kernels.QUICK_SHAPES
    return kernels.CUDA_SHAPES if bench_device().type == "cuda" else kernels.CPU_SHAPES
