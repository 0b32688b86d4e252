"""logprobs: portarl backends vs eager, TRL-style row loop and Liger; fwd / fwd+bwd, +-entropy."""

from __future__ import annotations

import pytest
import torch

from bench_setup import bench_device, bench_shapes
from portarl.bench import kernels
from portarl.parity.record import synchronize

METHODS = list(kernels.logprob_methods(bench_device()))


@pytest.mark.parametrize("mode", ["fwd", "fwd+entropy", "fwd+bwd", "fwd+bwd+entropy"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", bench_shapes(), ids=lambda s: f"N{s[0]}xV{s[1]}")
def test_logprobs(benchmark, device, shape, dtype, method, mode):
    n, v = shape
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(n, v, generator=gen)).to(dtype).to(device)
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    call = kernels._logprob_call(kernels.logprob_methods(device)[method], logits, labels, mode)
    try:
        call()
    except NotImplementedError as err:
        pytest.skip(str(err))

    def run():
        call()
        synchronize(device)

    benchmark.extra_info.update(n=n, v=v, method=method, mode=mode)
    benchmark(run)
