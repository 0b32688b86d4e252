"""Every tolerance portarl's parity tests and reports use, in one place.

Principle: the ops accumulate in fp32 whatever the input dtype, and every float64
reference is computed on the *same input values* (the low-precision inputs upcast), so a
bf16 input excuses no bf16-sized error in a result. Two error sources remain:

* fp32 arithmetic, which scales with the magnitude of what is summed or subtracted:
  ``FP32_ACCUM_ATOL * (1 + scale)`` where ``scale`` is max|z| (z = logits / T) for the
  log-prob op and max|input| for the KL op;
* the final rounding of a result stored in a narrow dtype (gradients come back in the
  input's dtype): the unit roundoff of that dtype, relative to the value, plus fp16's
  subnormal spacing in absolute terms.

An element passes when ``|actual - expected| <= atol + rtol * |expected|``.
"""

from __future__ import annotations

import dataclasses

import torch

#: Allowed fp32 accumulation error per unit of input scale.
FP32_ACCUM_ATOL = 1e-5

#: Relative rounding error of storing an exactly computed value in each dtype.
STORAGE_RTOL = {
    torch.float32: 1e-6,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}
#: Absolute rounding error floor (fp16 subnormal spacing; bf16 shares fp32's exponent range).
STORAGE_ATOL = {
    torch.float32: 0.0,
    torch.bfloat16: 0.0,
    torch.float16: 2.0**-24,
}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def allowed(self, expected: torch.Tensor) -> torch.Tensor:
        return self.atol + self.rtol * expected.abs()


def fp32_result(scale: float) -> Tolerance:
    """An fp32 output (log-probs, entropy, KL values) computed from inputs of magnitude ``scale``."""
    return Tolerance(atol=FP32_ACCUM_ATOL * (1.0 + scale), rtol=0.0)


def stored_gradient(scale: float, upstream: float, dtype: torch.dtype) -> Tolerance:
    """A gradient computed in fp32 and stored in ``dtype``.

    ``upstream`` bounds the incoming gradient times any chain factor (1 / temperature).
    """
    return Tolerance(
        atol=FP32_ACCUM_ATOL * (1.0 + scale) * upstream + STORAGE_ATOL[dtype],
        rtol=STORAGE_RTOL[dtype],
    )


def low_precision_forward(scale: float, dtype: torch.dtype) -> Tolerance:
    """fp32 log-probs of one bf16 / fp16 model from two forwards that round its activations
    differently (the same tokens packed or padded, another kernel blocking): every
    activation is stored in ``dtype``, so the two results are two roundings apart relative
    to the value (2 x ``STORAGE_RTOL``, as for a gradient stored twice), plus the fp32 log-prob
    op's own error at logit scale ``scale``. For an fp32 model use :func:`fp32_result`."""
    return Tolerance(atol=FP32_ACCUM_ATOL * (1.0 + scale), rtol=2 * STORAGE_RTOL[dtype])


#: Rollout engine vs trainer, fp32, same weights and temperature: two different fp32
#: implementations of the same forward (vLLM's attention / fused kernels vs the HF model)
#: differ by accumulated rounding, ~1e-6 per layer on small models; 1e-4 nats per token
#: bounds it with room for the reduction-order differences of multi-threaded CPU kernels.
ROLLOUT_FP32_ATOL = 1e-4
#: A bf16 engine must differ measurably from an fp32 trainer (the point of the mismatch
#: metrics): its *mean* per-token |d logp| exceeds twice the bound on the fp32 engine's
#: *maximum* difference, so it cannot be mistaken for fp32 rounding.
ROLLOUT_BF16_MIN_MEAN_DIFF = 2 * ROLLOUT_FP32_ATOL


#: A low-precision model's result computed by another path (the sequence cut across ranks,
#: another packing of the same tokens) against the float64 result of the same parameters: its
#: error may be at most this many times the error of the reference path in the same dtype.
#: Why a ratio and not a rounding-level tolerance: a bf16 backward rounds every activation
#: and every gradient it stores, each sum in another order on another path, so the two paths'
#: gradients differ by much more than one rounding (up to 0.036 on a tiny model's bf16
#: parameters) while both are equally good approximations of the exact one. This is
#: flash-attention's criterion for its kernels against the PyTorch implementation in the same
#: dtype (2x). Measured: Ulysses at SP 2 in bf16 and fp16, at most 1.54x per tensor
#: (tests/distributed/ulysses_worker.py); a 3% error in the all-to-all's backward fails it
#: (0.21 against the 0.072 allowed on the embedding's gradient).
LOW_PRECISION_PATH_ERROR_RATIO = 2.0


def low_precision_path(reference_error: float, scale: float) -> Tolerance:
    """An element of a low-precision model's result (a gradient, log-probs) by another path,
    compared with float64: at most :data:`LOW_PRECISION_PATH_ERROR_RATIO` times
    ``reference_error`` (max |reference path - float64| of the same tensor), plus the fp32
    arithmetic floor at magnitude ``scale`` (so that an exactly computed reference does not
    demand an exact result)."""
    return Tolerance(atol=LOW_PRECISION_PATH_ERROR_RATIO * reference_error + FP32_ACCUM_ATOL * (1.0 + scale),
                     rtol=0.0)


def contracted_gradient(scale: float, mass: float, dtype: torch.dtype) -> Tolerance:
    """A gradient that is an fp32 sum of products (linear_logprobs' d/d hidden, d/d weight),
    stored in ``dtype``. ``mass`` bounds the sum of |terms| (for d/d hidden: sum over the
    vocabulary of |d logits| * max|weight|; for d/d weight: sum over rows of |d logits| *
    max|hidden|): fp32 accumulation error is relative to it, as for :func:`stored_gradient`."""
    return stored_gradient(scale, mass, dtype)
