"""Triton kernels: per-token KL estimators k1, k2, k3 and their backward.

Elementwise over flattened, contiguous inputs in blocks of ``BLOCK`` elements; fp32
arithmetic whatever the input dtype. ``d = ref_logp - logp``. The grid is persistent
(:mod:`portarl.backends.cuda.grid`): each program takes blocks ``pid, pid + programs, ...``,
so a launch never needs more than ``MAX_PROGRAMS`` programs whatever the element count.

    k1 = -d                       dk/dd = -1
    k2 = d * d / 2                dk/dd = d
    k3 = exp(dc) - dc - 1         dc = clamp(d, -log_ratio_clamp, log_ratio_clamp)
         then min(k3, max_value)  dk/dd = exp(dc) - 1 inside both clamps, else 0

The clamps apply to k3 only and follow ``torch.clamp``'s gradient convention (the
gradient passes at the boundary, inclusive). ``HAS_MASK``: masked-out positions give 0
and zero gradient even where the inputs are NaN or inf. Clamps propagate NaN, so a NaN
input on an unmasked position gives NaN, never a clamped finite number.
"""

import triton
import triton.language as tl

from portarl.kernels.rounding import cast_for_store

#: Launch configuration of both kernels (elementwise, no loop: nothing to pipeline).
LAUNCH = {"BLOCK": 1024, "num_warps": 4, "num_stages": 1}

K1: tl.constexpr = 1
K2: tl.constexpr = 2
K3: tl.constexpr = 3


@triton.jit
def _k3_parts(d, log_ratio_clamp, max_value, CLAMP_RATIO: tl.constexpr, CLAMP_VALUE: tl.constexpr):
    if CLAMP_RATIO:
        dc = tl.minimum(
            tl.maximum(d, -log_ratio_clamp, propagate_nan=tl.PropagateNan.ALL),
            log_ratio_clamp,
            propagate_nan=tl.PropagateNan.ALL,
        )
        passes = (d >= -log_ratio_clamp) & (d <= log_ratio_clamp)
    else:
        dc = d
        passes = d == d
    ed = tl.exp(dc)
    value = ed - dc - 1.0
    if CLAMP_VALUE:
        passes = passes & (value <= max_value)
        value = tl.minimum(value, max_value, propagate_nan=tl.PropagateNan.ALL)
    return value, tl.where(passes, ed - 1.0, 0.0)


@triton.jit
def kl_forward_kernel(
    logp_ptr,
    ref_ptr,
    mask_ptr,
    out_ptr,
    n_elements,
    log_ratio_clamp,
    max_value,
    ESTIMATOR: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CLAMP_RATIO: tl.constexpr,
    CLAMP_VALUE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    for block in range(tl.program_id(0), tl.cdiv(n_elements, BLOCK), tl.num_programs(0)):
        offs = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n_elements
        logp = tl.load(logp_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        ref = tl.load(ref_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        d = ref - logp
        if ESTIMATOR == 1:
            value = -d
        elif ESTIMATOR == 2:
            value = 0.5 * d * d
        else:
            value, _ = _k3_parts(d, log_ratio_clamp, max_value, CLAMP_RATIO, CLAMP_VALUE)
        if HAS_MASK:
            keep = tl.load(mask_ptr + offs, mask=inside, other=0) != 0
            value = tl.where(keep, value, 0.0)
        tl.store(out_ptr + offs, value, mask=inside)


@triton.jit
def kl_backward_kernel(
    logp_ptr,
    ref_ptr,
    mask_ptr,
    grad_out_ptr,
    grad_logp_ptr,
    grad_ref_ptr,
    n_elements,
    log_ratio_clamp,
    max_value,
    ESTIMATOR: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CLAMP_RATIO: tl.constexpr,
    CLAMP_VALUE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_BF16_LOGP: tl.constexpr,
    ROUND_BF16_REF: tl.constexpr,
):
    for block in range(tl.program_id(0), tl.cdiv(n_elements, BLOCK), tl.num_programs(0)):
        offs = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n_elements
        logp = tl.load(logp_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        ref = tl.load(ref_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(grad_out_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        d = ref - logp
        if ESTIMATOR == 1:
            dk_dd = tl.full([BLOCK], -1.0, tl.float32)
        elif ESTIMATOR == 2:
            dk_dd = d
        else:
            _, dk_dd = _k3_parts(d, log_ratio_clamp, max_value, CLAMP_RATIO, CLAMP_VALUE)
        grad_d = g * dk_dd
        if HAS_MASK:
            keep = tl.load(mask_ptr + offs, mask=inside, other=0) != 0
            grad_d = tl.where(keep, grad_d, 0.0)
        tl.store(grad_ref_ptr + offs, cast_for_store(grad_d, grad_ref_ptr, ROUND_BF16_REF), mask=inside)
        tl.store(grad_logp_ptr + offs, cast_for_store(-grad_d, grad_logp_ptr, ROUND_BF16_LOGP), mask=inside)


# ------------------------------------------------------------------ ahead-of-time variants
def _aot_variants() -> list:
    """Every constexpr combination :mod:`portarl.backends.cuda.kl` launches on a GPU: the
    clamp flags only for k3 (the host sets them to False for k1 / k2, which ignore them),
    bf16 inputs, plus fp32 / fp16 for the full k3 variant. ``ROUND_BF16_*`` is True only
    under the interpreter. ``mask_ptr`` is uint8 (a bool mask viewed as bytes) or, without a
    mask, a dummy of the inputs' dtype."""
    config = dict(LAUNCH)
    warps, stages = config.pop("num_warps"), config.pop("num_stages")
    variants = []
    for estimator in (1, 2, 3):
        clamps = [(r, v) for r in (False, True) for v in (False, True)] if estimator == 3 else [(False, False)]
        for has_mask in (False, True):
            for clamp_ratio, clamp_value in clamps:
                full = estimator == 3 and has_mask and clamp_ratio and clamp_value
                for dt in ("bf16", "fp32", "fp16") if full else ("bf16",):
                    flags = dict(ESTIMATOR=estimator, HAS_MASK=has_mask, CLAMP_RATIO=clamp_ratio,
                                 CLAMP_VALUE=clamp_value, **config)
                    types = {"logp_ptr": f"*{dt}", "ref_ptr": f"*{dt}", "mask_ptr": "*u8" if has_mask else f"*{dt}",
                             "out_ptr": "*fp32", "grad_out_ptr": "*fp32", "grad_logp_ptr": f"*{dt}",
                             "grad_ref_ptr": f"*{dt}", "n_elements": "i32", "log_ratio_clamp": "fp32",
                             "max_value": "fp32"}
                    for kernel, extra in ((kl_forward_kernel, {}),
                                          (kl_backward_kernel, dict(ROUND_BF16_LOGP=False, ROUND_BF16_REF=False))):
                        constexprs = {**flags, **extra}
                        signature = {a: ("constexpr" if a in constexprs else types[a]) for a in kernel.arg_names}
                        variants.append({"kernel": kernel, "signature": signature, "constexprs": constexprs,
                                         "num_warps": warps, "num_stages": stages})
    return variants


#: See :data:`portarl.kernels.logprobs.AOT_VARIANTS`.
AOT_VARIANTS = _aot_variants()
