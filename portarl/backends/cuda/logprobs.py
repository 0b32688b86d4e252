"""Host side of the Triton log-probs / entropy kernels: launch, autograd, tile choice."""

from __future__ import annotations

import torch
import triton

from portarl.backends.rows import row_offsets
from portarl.kernels import logprobs_backward_kernel, logprobs_forward_kernel, round_bf16_in_interpreter

#: Largest tile of a row held at once (columns). Tiles depend on V only: batch invariance.
MAX_BLOCK_V = 4096


def block_for(n_cols: int) -> int:
    return min(MAX_BLOCK_V, max(16, triton.next_power_of_2(n_cols)))


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


class TritonLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, inv_temperature, ignore_index, with_entropy):
        n_cols = logits.shape[-1]
        n_rows = labels.numel()
        offsets = row_offsets(logits)
        logp = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        block = block_for(n_cols)
        logprobs_forward_kernel[(n_rows,)](
            logits,
            offsets,
            logits.stride(-1),
            labels,
            logp,
            entropy if with_entropy else lse,
            lse,
            n_cols,
            inv_temperature,
            ignore_index,
            BLOCK_V=block,
            WITH_ENTROPY=with_entropy,
            num_warps=_num_warps(block),
        )
        ctx.save_for_backward(logits, labels, offsets, lse, entropy)
        ctx.inv_temperature = inv_temperature
        ctx.ignore_index = ignore_index
        ctx.with_entropy = with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, labels, offsets, lse, entropy = ctx.saved_tensors
        n_cols = logits.shape[-1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.contiguous()
        use_entropy = ctx.with_entropy and g_entropy is not None
        block = block_for(n_cols)
        logprobs_backward_kernel[(labels.numel(),)](
            logits,
            offsets,
            logits.stride(-1),
            labels,
            lse,
            entropy if use_entropy else lse,
            g_logp,
            g_entropy.contiguous() if use_entropy else g_logp,
            grad,
            n_cols,
            ctx.inv_temperature,
            ctx.ignore_index,
            BLOCK_V=block,
            WITH_ENTROPY=use_entropy,
            ROUND_BF16=round_bf16_in_interpreter(grad.dtype),
            num_warps=_num_warps(block),
        )
        return grad, None, None, None, None


def triton_logprobs(logits, labels, *, temperature, ignore_index, return_entropy):
    return TritonLogprobs.apply(logits, labels.contiguous(), 1.0 / temperature, ignore_index, return_entropy)
