"""Host side of the Triton KL estimator kernels: launch and autograd."""

from __future__ import annotations

import torch
import triton

from portarl.backends.cuda import grid
from portarl.kernels import kl_backward_kernel, kl_forward_kernel, round_bf16_in_interpreter
from portarl.kernels.kl import LAUNCH

_ESTIMATOR_CODE = {"k1": 1, "k2": 2, "k3": 3}
BLOCK = LAUNCH["BLOCK"]


def _mask_bytes(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return like  # never read: HAS_MASK=False
    return mask.contiguous().view(torch.uint8)


class TritonKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, ref_logp, mask, estimator, log_ratio_clamp, max_value):
        logp_c, ref_c = logp.contiguous(), ref_logp.contiguous()
        mask_c = _mask_bytes(mask, logp_c)
        out = torch.empty(logp.shape, dtype=torch.float32, device=logp.device)
        n = logp_c.numel()
        k3 = estimator == "k3"  # the clamps apply to k3 only: one compiled variant fewer per flag
        params = dict(
            ESTIMATOR=_ESTIMATOR_CODE[estimator],
            HAS_MASK=mask is not None,
            CLAMP_RATIO=k3 and log_ratio_clamp is not None,
            CLAMP_VALUE=k3 and max_value is not None,
            **LAUNCH,
        )
        clamps = (
            float(log_ratio_clamp) if log_ratio_clamp is not None else 0.0,
            float(max_value) if max_value is not None else 0.0,
        )
        if n:
            kl_forward_kernel[grid.programs(triton.cdiv(n, BLOCK))](logp_c, ref_c, mask_c, out, n, *clamps, **params)
        ctx.save_for_backward(logp_c, ref_c, mask_c)
        ctx.params, ctx.clamps = params, clamps
        ctx.dtypes = (logp.dtype, ref_logp.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logp_c, ref_c, mask_c = ctx.saved_tensors
        grad_logp = torch.empty(logp_c.shape, dtype=ctx.dtypes[0], device=logp_c.device)
        grad_ref = torch.empty(ref_c.shape, dtype=ctx.dtypes[1], device=ref_c.device)
        n = logp_c.numel()
        if n:
            kl_backward_kernel[grid.programs(triton.cdiv(n, BLOCK))](
                logp_c, ref_c, mask_c, grad_out.contiguous(), grad_logp, grad_ref, n, *ctx.clamps, **ctx.params,
                ROUND_BF16_LOGP=round_bf16_in_interpreter(grad_logp.dtype),
                ROUND_BF16_REF=round_bf16_in_interpreter(grad_ref.dtype),
            )
        return grad_logp, grad_ref, None, None, None, None


def triton_kl(logp, ref_logp, *, estimator, mask, log_ratio_clamp, max_value):
    return TritonKL.apply(logp, ref_logp, mask, estimator, log_ratio_clamp, max_value)
