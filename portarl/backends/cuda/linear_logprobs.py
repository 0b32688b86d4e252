"""Host side of the Triton fused linear log-probs: row chunks, launches, autograd.

The chunk loop is :mod:`portarl.backends._linear_chunks` (shared with the npu backend);
per chunk of ``n`` rows (``n * V`` within ``PORTARL_CHUNK_ELEMENTS``): the fp32 logits tile
is computed by ``linear_tile_kernel`` into one reusable [n, V] buffer, reduced by
``tile_logprobs_forward_kernel``; backward recomputes the tile into the same buffer, turns
it into its gradient in place, and contracts it with the weight (grad_hidden, fp32, cast
per chunk) and the chunk's hidden states (grad_weight, accumulated in one fp32 [V, H]
buffer over the chunks, cast once at the end). Nothing N x V exists in either direction.
"""

from __future__ import annotations

import torch
import triton

from portarl.backends._linear_chunks import ChunkMath, backward_chunks, forward_chunks
from portarl.backends.cuda import grid
from portarl.kernels import INTERPRETED
from portarl.kernels.linear_logprobs import (
    aligned_shape,
    linear_tile_kernel,
    row_config,
    tile_config,
    tile_logprobs_backward_kernel,
    tile_logprobs_forward_kernel,
)

_TRITON_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def matmul_into(c, a, b, *, aligned, bias=None, scale=1.0, accumulate=False):
    """fp32 ``c`` [M, N] (+)= (a [M, K] @ b [K, N] + bias) * scale; any strides.

    The tile (and whether the tensor cores run it) is :func:`tile_config` of the two dtypes
    and ``aligned`` (:func:`aligned_shape` of H and V: the same for every chunk).
    """
    m, k = a.shape
    n = b.shape[1]
    config = tile_config(_TRITON_DTYPE[a.dtype], _TRITON_DTYPE[b.dtype], aligned)
    tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    linear_tile_kernel[grid.programs(tiles)](
        a, b, bias if bias is not None else b, c,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        scale,
        HAS_BIAS=bias is not None, ACCUMULATE=accumulate, BROADCAST_DOT=INTERPRETED, **config,
    )
    return c


class TritonChunkMath(ChunkMath):
    """Triton tiles: one reusable fp32 [step, V] logits buffer (and [step, H] for grad_hidden)."""

    def start(self, step, vocab, device):
        self.step, self.device = step, device
        self.buf = torch.empty(step, vocab, dtype=torch.float32, device=device)
        self.gh32 = None

    def logits(self, rows, weight, bias, inv_t):
        return matmul_into(self.buf[: rows.shape[0]], rows, weight.T, bias=bias, scale=inv_t,
                           aligned=aligned_shape(weight.shape[1], weight.shape[0]))

    def grad_hidden(self, grad_z, weight):
        if self.gh32 is None:
            self.gh32 = torch.empty(self.step, weight.shape[1], dtype=torch.float32, device=self.device)
        return matmul_into(self.gh32[: grad_z.shape[0]], grad_z, weight,
                           aligned=aligned_shape(weight.shape[1], weight.shape[0]))

    def accumulate_grad_weight(self, gw32, grad_z, rows):
        matmul_into(gw32, grad_z.T, rows, accumulate=True, aligned=aligned_shape(gw32.shape[1], gw32.shape[0]))


class TritonLinearLogprobs(torch.autograd.Function):
    """The chunked heads: ``math`` (a :class:`ChunkMath` class) computes and contracts each
    chunk's logits tile (``TritonChunkMath``: the Triton tile; the ``cublas`` head's
    ``FixedChunkMath``: cuBLAS on fixed-shape chunks); the Triton row kernels do the rest."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_t, ignore_index, with_entropy, math=TritonChunkMath):
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        logp = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        config = row_config(vocab)

        def row_forward(r0, r1, z):
            tile_logprobs_forward_kernel[grid.programs(r1 - r0)](
                z, labels[r0:r1], logp[r0:r1], (entropy if with_entropy else lse)[r0:r1], lse[r0:r1],
                r1 - r0, vocab, ignore_index, WITH_ENTROPY=with_entropy, **config,
            )

        forward_chunks(math(), hidden, weight, bias, inv_t, row_forward)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.inv_t, ctx.ignore_index, ctx.with_entropy, ctx.math = inv_t, ignore_index, with_entropy, math
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
        use_h = ctx.with_entropy and g_entropy is not None
        g_ent = g_entropy.float().contiguous() if use_h else g_logp
        config = row_config(weight.shape[0])

        def row_backward(r0, r1, z):  # in place: the tile becomes its gradient
            tile_logprobs_backward_kernel[grid.programs(r1 - r0)](
                z, labels[r0:r1], lse[r0:r1], (entropy if use_h else lse)[r0:r1], g_logp[r0:r1], g_ent[r0:r1],
                r1 - r0, weight.shape[0], ctx.inv_t, ctx.ignore_index, WITH_ENTROPY=use_h, **config,
            )
            return z

        grads = backward_chunks(ctx.math(), hidden, weight, bias, ctx.inv_t, row_backward, ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None, None)


def triton_linear_logprobs(hidden, weight, bias, labels, *, temperature, ignore_index, return_entropy,
                           math=TritonChunkMath):
    return TritonLinearLogprobs.apply(hidden, weight, bias, labels.contiguous(), 1.0 / temperature, ignore_index,
                                      return_entropy, math)
