"""Store-side rounding that matches the hardware under the Triton interpreter.

On a GPU, ``x.to(tl.bfloat16)`` from fp32 rounds to nearest even (Triton's default for
float downcasts). The Triton 3.x interpreter truncates instead (its numpy cast ignores the
rounding mode), which doubles the rounding error of every bf16 gradient in CI. Kernels
therefore take a ``ROUND_BF16`` constexpr, set by the host only when the kernels are
interpreted and the output is bf16, and round with integer arithmetic here; compiled
kernels keep the native cast.
"""

import triton
import triton.language as tl


@triton.jit
def bf16_round_nearest_even(x):
    """fp32 -> bf16, round to nearest, ties to even, on the bit pattern; NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x == x, out, x.to(tl.bfloat16))


@triton.jit
def cast_for_store(x, out_ptr, ROUND_BF16: tl.constexpr):
    """``x`` (fp32) in the element type of ``out_ptr``, rounded as the hardware rounds."""
    if ROUND_BF16:
        return bf16_round_nearest_even(x)
    else:
        return x.to(out_ptr.dtype.element_ty)


#: Helpers only (inlined into the kernels that call them, and compiled with those): no
#: launchable kernel of their own. See :data:`portarl.kernels.logprobs.AOT_VARIANTS`.
AOT_VARIANTS: list = []
