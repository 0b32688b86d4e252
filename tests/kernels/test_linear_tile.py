"""linear_tile_kernel's tile product on its own, under the interpreter, against float64.

Every dtype pair the host launches, on the big (aligned) and the small tile: the result is
an fp32 sum of exact products. For the fp32 gradient tile against a bf16 / fp16 operand
that is what the exact three-piece split of the fp32 operand gives, and what a cast of it
to the 16-bit dtype (Liger's and eager bf16 autograd's choice) would lose: 2**-9 relative
per term, a hundred times the fp32 allowance checked here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from portarl.parity.tolerances import FP32_ACCUM_ATOL  # noqa: E402

NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PAIRS = [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "bf16"), ("fp32", "fp16")]


def _interpreted() -> bool:
    from portarl.backends import get_backend_by_name

    return get_backend_by_name("cuda").unavailable_reason(torch.device("cpu")) is None


@pytest.mark.skipif(not _interpreted(), reason="Triton kernels not built for the interpreter (set TRITON_INTERPRET=1)")
@pytest.mark.parametrize("aligned", [True, False], ids=["big-tile", "small-tile"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
def test_tile_is_an_fp32_sum_of_exact_products(pair, aligned):
    from portarl.backends.cuda.linear_logprobs import matmul_into

    gen = torch.Generator().manual_seed(5)
    m, k, n = 37, 150, 70  # partial tiles in every direction, K over several steps of both tiles
    # A's values spread over many binades, with all 24 significand bits in use (fp32).
    a = (torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-12, 4, (m, k), generator=gen).float()))
    a = a.to(NAMES[pair[0]])
    b = torch.randn(k, n, generator=gen).to(NAMES[pair[1]])
    bias = torch.randn(n, generator=gen).to(NAMES[pair[1]])
    c = torch.full((m, n), 0.25)
    matmul_into(c, a, b, bias=bias, scale=0.5, accumulate=True, aligned=aligned)
    exact = (a.double() @ b.double() + bias.double()) * 0.5 + 0.25
    mass = (a.double().abs() @ b.double().abs() + bias.double().abs()) * 0.5 + 0.25
    err = (c.double() - exact).abs()
    # fp32 accumulation: a few units of 2**-24 of the summed magnitudes, far inside FP32_ACCUM_ATOL.
    assert (err <= FP32_ACCUM_ATOL * mass).all(), float((err / mass).max())
    assert float((err / mass).max()) < 2.0**-20
