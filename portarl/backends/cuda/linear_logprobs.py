"""Host side of the Triton fused linear log-probs: row chunks, launches, autograd.

Per chunk of ``n`` rows (``n * V`` within ``PORTARL_CHUNK_ELEMENTS``): the fp32 logits tile
is computed by ``linear_tile_kernel`` into one reusable [n, V] buffer, reduced by
``tile_logprobs_forward_kernel``; backward recomputes the tile into the same buffer, turns
it into its gradient in place, and contracts it with the weight (grad_hidden, fp32, cast
per chunk) and the chunk's hidden states (grad_weight, accumulated in one fp32 [V, H]
buffer over the chunks, cast once at the end). Nothing N x V exists in either direction.
"""

from __future__ import annotations

import torch
import triton

from portarl.backends.rows import chunk_rows
from portarl.kernels import INTERPRETED
from portarl.kernels.linear_logprobs import (
    BLOCK_K,
    BLOCK_M,
    BLOCK_N,
    MAX_BLOCK_V,
    TILE_STAGES,
    TILE_WARPS,
    linear_tile_kernel,
    tile_logprobs_backward_kernel,
    tile_logprobs_forward_kernel,
)


def _block_v(n_cols: int) -> int:
    return min(MAX_BLOCK_V, max(16, triton.next_power_of_2(n_cols)))


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def matmul_into(c, a, b, *, bias=None, scale=1.0, accumulate=False):
    """fp32 ``c`` [M, N] (+)= (a [M, K] @ b [K, N] + bias) * scale; any strides."""
    m, k = a.shape
    n = b.shape[1]
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    linear_tile_kernel[grid](
        a, b, bias if bias is not None else b, c,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        scale,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        HAS_BIAS=bias is not None, ACCUMULATE=accumulate, BROADCAST_DOT=INTERPRETED, num_warps=TILE_WARPS, num_stages=TILE_STAGES,
    )
    return c


class TritonLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_t, ignore_index, with_entropy):
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        step = chunk_rows(vocab, max_rows=n_rows)
        dev = hidden.device
        buf = torch.empty(step, vocab, dtype=torch.float32, device=dev)
        logp = torch.empty(n_rows, dtype=torch.float32, device=dev)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        block = _block_v(vocab)
        for r0 in range(0, n_rows, step):
            r1 = min(n_rows, r0 + step)
            z = matmul_into(buf[: r1 - r0], hidden[r0:r1], weight.T, bias=bias, scale=inv_t)
            tile_logprobs_forward_kernel[(r1 - r0,)](
                z, labels[r0:r1], logp[r0:r1], (entropy if with_entropy else lse)[r0:r1], lse[r0:r1],
                vocab, ignore_index, BLOCK_V=block, WITH_ENTROPY=with_entropy, num_warps=_warps(block),
            )
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.inv_t, ctx.ignore_index, ctx.with_entropy = inv_t, ignore_index, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        dev = hidden.device
        step = chunk_rows(vocab, max_rows=n_rows)
        buf = torch.empty(step, vocab, dtype=torch.float32, device=dev)
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
        use_h = ctx.with_entropy and g_entropy is not None
        g_ent = g_entropy.float().contiguous() if use_h else g_logp
        grad_h = torch.empty_like(hidden) if want_h else None
        gh32 = torch.empty(step, hidden.shape[1], dtype=torch.float32, device=dev) if want_h else None
        gw32 = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if want_w else None
        gb32 = torch.zeros(vocab, dtype=torch.float32, device=dev) if want_b else None
        block = _block_v(vocab)
        for r0 in range(0, n_rows, step):
            r1 = min(n_rows, r0 + step)
            z = matmul_into(buf[: r1 - r0], hidden[r0:r1], weight.T, bias=bias, scale=ctx.inv_t)
            tile_logprobs_backward_kernel[(r1 - r0,)](
                z, labels[r0:r1], lse[r0:r1], (entropy if use_h else lse)[r0:r1], g_logp[r0:r1], g_ent[r0:r1],
                vocab, ctx.inv_t, ctx.ignore_index, BLOCK_V=block, WITH_ENTROPY=use_h, num_warps=_warps(block),
            )
            if want_h:
                grad_h[r0:r1] = matmul_into(gh32[: r1 - r0], z, weight)
            if want_w:
                matmul_into(gw32, z.T, hidden[r0:r1], accumulate=True)
            if want_b:
                gb32 += z.sum(dim=0)
        grad_w = gw32.to(weight.dtype) if want_w else None
        grad_b = gb32.to(bias.dtype) if want_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def triton_linear_logprobs(hidden, weight, bias, labels, *, temperature, ignore_index, return_entropy):
    return TritonLinearLogprobs.apply(hidden, weight, bias, labels.contiguous(), 1.0 / temperature, ignore_index,
                                      return_entropy)
