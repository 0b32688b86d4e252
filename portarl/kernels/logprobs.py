"""Triton kernels: per-row log-softmax gather, fused entropy, and their backward.

Layout follows flash-attention's Triton cross-entropy: one program per row, the row
walked left to right in tiles of ``BLOCK_V`` columns with an online logsumexp, all
arithmetic in fp32 whatever the logits' dtype. The tile size is a function of the
vocabulary size alone and the tile order is fixed, so the floating-point operations
that produce a row's result never depend on the other rows: results are bitwise
batch-invariant.

Rows are addressed through a per-row element offset (``row_offsets``) plus a column
stride, which lets the kernel read any strided view (for example ``logits[:, :-1]``)
without first copying it into an N x V buffer.

Entropy is accumulated relative to the running maximum m:
    s = sum exp(z - m),  t = sum exp(z - m) * (z - m),  H = log(s) - t / s
which keeps both terms O(log V) even for logits of magnitude 1e4 (accumulating
sum p * z directly would cancel two numbers of size |z|).
"""

import triton
import triton.language as tl

from portarl.kernels.rounding import cast_for_store


@triton.jit
def logprobs_forward_kernel(
    logits_ptr,
    row_offsets_ptr,
    col_stride,
    labels_ptr,
    logp_ptr,
    entropy_ptr,
    lse_ptr,
    n_cols,
    inv_temperature,
    ignore_index,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    row_ptr = logits_ptr + tl.load(row_offsets_ptr + row)
    if label == ignore_index:
        tl.store(logp_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)
    else:
        cols = tl.arange(0, BLOCK_V)
        m = -float("inf")
        s = 0.0
        t = 0.0
        for start in range(0, n_cols, BLOCK_V):
            idx = start + cols
            in_row = idx < n_cols
            x = tl.load(row_ptr + idx * col_stride, mask=in_row, other=-float("inf"))
            z = x.to(tl.float32) * inv_temperature
            m_new = tl.maximum(m, tl.max(z, axis=0))
            # All entries so far -inf: shift by 0 so exp() sees -inf, not nan (-inf - -inf).
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            e = tl.exp(z - shift)
            scale = tl.exp(m - shift)
            s_prev = s
            s = s * scale + tl.sum(e, axis=0)
            if WITH_ENTROPY:
                # p * (z - m) is 0 where p is 0, also for z = -inf (0 * -inf would be nan).
                tile_t = tl.sum(tl.where(e > 0.0, e * (z - shift), 0.0), axis=0)
                moved = tl.where(s_prev > 0.0, (m - shift) * s_prev, 0.0)
                t = scale * (t + moved) + tile_t
            m = m_new
        shift = tl.where(m == -float("inf"), 0.0, m)
        log_s = tl.log(s)
        lse = shift + log_s
        z_label = tl.load(row_ptr + label * col_stride).to(tl.float32) * inv_temperature
        tl.store(logp_ptr + row, z_label - lse)
        tl.store(lse_ptr + row, lse)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, log_s - t / s)


@triton.jit
def logprobs_backward_kernel(
    logits_ptr,
    row_offsets_ptr,
    col_stride,
    labels_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    grad_logits_ptr,
    n_cols,
    inv_temperature,
    ignore_index,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """grad_z = g_logp * (onehot - p) - g_H * p * (log p + H); grad_logits = grad_z / T.

    ``grad_logits`` is a contiguous [N, V] buffer in the logits' dtype.
    """
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    row_ptr = logits_ptr + tl.load(row_offsets_ptr + row)
    out_ptr = grad_logits_ptr + row * n_cols
    cols = tl.arange(0, BLOCK_V)
    if label == ignore_index:
        for start in range(0, n_cols, BLOCK_V):
            idx = start + cols
            zeros = tl.zeros([BLOCK_V], dtype=tl.float32)
            tl.store(out_ptr + idx, cast_for_store(zeros, grad_logits_ptr, ROUND_BF16), mask=idx < n_cols)
    else:
        lse = tl.load(lse_ptr + row)
        g_logp = tl.load(grad_logp_ptr + row)
        if WITH_ENTROPY:
            g_h = tl.load(grad_entropy_ptr + row)
            h = tl.load(entropy_ptr + row)
        for start in range(0, n_cols, BLOCK_V):
            idx = start + cols
            in_row = idx < n_cols
            x = tl.load(row_ptr + idx * col_stride, mask=in_row, other=-float("inf"))
            z = x.to(tl.float32) * inv_temperature
            logp = z - lse
            p = tl.exp(logp)
            grad = tl.where(idx == label, g_logp, 0.0) - g_logp * p
            if WITH_ENTROPY:
                grad -= tl.where(p > 0.0, g_h * p * (logp + h), 0.0)
            grad = grad * inv_temperature
            tl.store(out_ptr + idx, cast_for_store(grad, grad_logits_ptr, ROUND_BF16), mask=in_row)
