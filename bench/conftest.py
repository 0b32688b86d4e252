"""pytest-benchmark set-up: ``pytest bench/ --benchmark-only``.

Shapes: the RL-typical grid on a GPU, small shapes on CPU, one tiny shape with
``PORTARL_BENCH_QUICK=1`` (the CI smoke run). The methods are those of
``portarl bench kernels`` (portarl.bench.kernels), so both report the same things.
"""

from __future__ import annotations

import os

import pytest
import torch

from portarl.bench import kernels


def bench_device() -> torch.device:
    from portarl.device import resolve_device

    return resolve_device(os.environ.get("PORTARL_BENCH_DEVICE", "auto"))


def bench_shapes() -> list[tuple[int, int]]:
    if os.environ.get("PORTARL_BENCH_QUICK") == "1":
        return kernels.QUICK_SHAPES
    return kernels.CUDA_SHAPES if bench_device().type == "cuda" else kernels.CPU_SHAPES


@pytest.fixture(scope="session")
def device() -> torch.device:
    return bench_device()
