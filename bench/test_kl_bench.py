"""kl (k3 with clamps): portarl backends vs the eager torch formula, per-token tensors."""

from __future__ import annotations

import pytest
import torch

from bench_setup import bench_device, bench_shapes
from portarl.bench import kernels
from portarl.parity.record import synchronize


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("method", list(kernels.kl_methods(bench_device())))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", sorted({n for n, _ in bench_shapes()}))
def test_kl(benchmark, device, n, dtype, method, mode):
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(n, generator=gen).to(dtype).to(device)
    ref = (logp.float() + 0.3 * torch.randn(n, generator=gen)).to(dtype).to(device)
    call = kernels._kl_call(kernels.kl_methods(device)[method], logp, ref, mode)

    def run():
        call()
        synchronize(device)

    benchmark(run)
