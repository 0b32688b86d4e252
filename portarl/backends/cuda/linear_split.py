"""Host side of the split-vocabulary head (``split``, :mod:`portarl.kernels.linear_split`).

Forward: rows in chunks whose partials ``[n, splits, 4]`` fp32 fit ``PORTARL_CHUNK_ELEMENTS``
(tens of thousands of rows at the default budget: the weight is read about once per chunk),
one :func:`split_forward_kernel` launch over the chunk's (row tile, split) items, one
:func:`split_merge_kernel` over its rows. Backward: the chunked head's driver
(:func:`portarl.backends._linear_chunks.backward_chunks`), with the chunk's logits gradient
written by :func:`split_grad_logits_kernel` straight into the reusable fp32 [n, V] buffer
(the logits are recomputed inside the kernel, never written), then contracted by the
chunked head's tile kernel. Nothing N x V exists in either direction.
"""

from __future__ import annotations

import torch
import triton

from portarl.backends._linear_chunks import backward_chunks
from portarl.backends.cuda import grid
from portarl.backends.cuda.linear_logprobs import _TRITON_DTYPE, TritonChunkMath
from portarl.backends.rows import chunk_rows
from portarl.kernels import INTERPRETED
from portarl.kernels.linear_logprobs import aligned_shape
from portarl.kernels.linear_split import (
    MAX_SPLITS,
    n_splits,
    split_config,
    split_forward_kernel,
    split_grad_logits_kernel,
    split_merge_kernel,
)


def _config(hidden, weight, kernel: str = "forward") -> dict:
    d = _TRITON_DTYPE[hidden.dtype]
    return split_config(d, d, weight.shape[0], aligned_shape(weight.shape[1], weight.shape[0]), kernel)


def split_forward(hidden, weight, bias, labels, inv_t, ignore_index, with_entropy):
    """``(logp, lse, entropy or None)`` fp32 [N] of the rows of ``hidden`` [N, H]."""
    n_rows, width = hidden.shape
    vocab = weight.shape[0]
    config = _config(hidden, weight)
    splits = n_splits(vocab, config["SPLIT"])
    logp = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    step = chunk_rows(splits * 4, max_rows=n_rows)
    part = torch.empty(step, splits, 4, dtype=torch.float32, device=hidden.device)
    tile = {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "DOT", "num_warps", "num_stages")}
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        rows = hidden[r0:r1]
        items = triton.cdiv(r1 - r0, config["BLOCK_M"]) * splits
        split_forward_kernel[grid.programs(items)](
            rows, weight, bias if bias is not None else weight, labels[r0:r1], part,
            r1 - r0, vocab, width, rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), inv_t,
            config["SPLIT"], HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, BROADCAST_DOT=INTERPRETED, **tile,
        )
        split_merge_kernel[grid.programs(r1 - r0)](
            part, labels[r0:r1], logp[r0:r1], lse[r0:r1], (entropy if with_entropy else lse)[r0:r1],
            r1 - r0, splits, ignore_index, BLOCK_S=MAX_SPLITS, WITH_ENTROPY=with_entropy, num_warps=4, num_stages=1,
        )
    return logp, lse, entropy


class SplitChunkMath(TritonChunkMath):
    """The chunked head's buffers and contractions; :meth:`logits` hands out the chunk's
    buffer unfilled, because the split kernel writes the gradient there directly."""

    def logits(self, rows, weight, bias, inv_t):
        return self.buf[: rows.shape[0]]


class SplitLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_t, ignore_index, with_entropy):
        logp, lse, entropy = split_forward(hidden, weight, bias, labels, inv_t, ignore_index, with_entropy)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.inv_t, ctx.ignore_index, ctx.with_entropy = inv_t, ignore_index, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
        use_h = ctx.with_entropy and g_entropy is not None
        g_ent = g_entropy.float().contiguous() if use_h else g_logp
        config = _config(hidden, weight, "grad")
        tile = {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "DOT", "num_warps", "num_stages")}
        vocab, width = weight.shape
        splits = n_splits(vocab, config["SPLIT"])

        def grad_logits(r0, r1, buf):  # the chunk's d loss / d logits, written into its buffer
            rows = hidden[r0:r1]
            split_grad_logits_kernel[grid.programs(triton.cdiv(r1 - r0, config["BLOCK_M"]) * splits)](
                rows, weight, bias if bias is not None else weight, labels[r0:r1], lse[r0:r1],
                (entropy if use_h else lse)[r0:r1], g_logp[r0:r1], g_ent[r0:r1], buf,
                r1 - r0, vocab, width, rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1),
                buf.stride(0), ctx.inv_t, ctx.ignore_index, config["SPLIT"],
                HAS_BIAS=bias is not None, WITH_ENTROPY=use_h, BROADCAST_DOT=INTERPRETED, **tile,
            )
            return buf

        grads = backward_chunks(SplitChunkMath(), hidden, weight, bias, ctx.inv_t, grad_logits, ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None)


def split_linear_logprobs(hidden, weight, bias, labels, *, temperature, ignore_index, return_entropy):
    return SplitLinearLogprobs.apply(hidden, weight, bias, labels.contiguous(), 1.0 / temperature, ignore_index,
                                     return_entropy)
