"""pytest-benchmark set-up: ``pytest bench/ --benchmark-only``.

Shapes: the RL-typical grid on a GPU, small shapes on CPU, one tiny shape with
``PORTARL_BENCH_QUICK=1`` (the CI smoke run). The methods are those of
``portarl bench kernels`` (portarl.bench.kernels), so both report the same things.
"""

from __future__ import annotations

import pytest
import torch

from bench_setup import bench_device


@pytest.fixture(scope="session")
def device() -> torch.device:
    return bench_device()
