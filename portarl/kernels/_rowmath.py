"""Row arithmetic shared by the log-prob kernels of ``logprobs`` and ``linear_logprobs``.

One place for the pieces both ops need, inlined by Triton into each kernel that calls
them (no launchable kernel here, so :data:`AOT_VARIANTS` is empty; the callers' variants
compile them):

- :func:`row_lse_entropy`: walk one row left to right in tiles of ``BLOCK_V`` columns with
  an online logsumexp and, with ``WITH_ENTROPY``, the max-relative entropy accumulator
      s = sum exp(z - m),  t = sum exp(z - m) * (z - m),  H = log(s) - t / s
  (m the running maximum; both terms stay O(log V) even for |z| ~ 1e4);
- :func:`store_row`: a row's forward results (logp, lse, H);
- :func:`softmax_grad`: d(g_logp * logp + g_H * H) / d logits for one tile of a row,
  grad = (g_logp * (onehot - p) - g_H * p * (log p + H)) / T, with
  :func:`row_grad_inputs` loading its per-row inputs.

Every floating-point operation, and its order, is the one the kernels performed before they
shared this code: results are bitwise unchanged, and a row's result depends on V alone (the
tile size is a function of V), never on the other rows.
"""

import triton
import triton.language as tl


@triton.jit
def row_lse_entropy(row_ptr, col_stride, n_cols, inv_temperature, BLOCK_V: tl.constexpr,
                    WITH_ENTROPY: tl.constexpr):
    """``(lse, H)`` of the row ``z = row_ptr[j * col_stride] * inv_temperature``, j < n_cols, in fp32.

    ``H`` is 0.0 (not computed) without ``WITH_ENTROPY``. Loads are upcast to fp32 before the
    scaling; a caller whose row already holds fp32 ``z`` passes ``inv_temperature = 1.0``
    (``z * 1.0 == z`` bitwise, NaN included).
    """
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    t = 0.0
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        x = tl.load(row_ptr + idx * col_stride, mask=idx < n_cols, other=-float("inf"))
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
    entropy = 0.0
    if WITH_ENTROPY:
        entropy = log_s - t / s
    return lse, entropy


@triton.jit
def store_row(row, logp, lse, entropy, logp_ptr, lse_ptr, entropy_ptr, WITH_ENTROPY: tl.constexpr):
    """A row's forward results: ``logp``, ``lse`` and, with ``WITH_ENTROPY``, ``entropy``
    (an ignored row stores 0.0 for each)."""
    tl.store(logp_ptr + row, logp)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, entropy)


@triton.jit
def row_grad_inputs(row, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, WITH_ENTROPY: tl.constexpr):
    """``(lse, g_logp, g_h, h)`` of ``row`` for :func:`softmax_grad`: the forward's row
    results and the incoming row gradients (fp32; ``g_h``, ``h`` are 0.0 without
    ``WITH_ENTROPY``, their pointers then unread)."""
    lse = tl.load(lse_ptr + row)
    g_logp = tl.load(grad_logp_ptr + row)
    g_h = 0.0
    h = 0.0
    if WITH_ENTROPY:
        g_h = tl.load(grad_entropy_ptr + row)
        h = tl.load(entropy_ptr + row)
    return lse, g_logp, g_h, h


@triton.jit
def softmax_grad(z, is_label, lse, g_logp, g_h, h, inv_temperature, WITH_ENTROPY: tl.constexpr):
    """Gradient w.r.t. the logits of one tile of a row (fp32), from the tile's fp32 ``z = logits / T``.

    ``is_label`` marks the label's column; ``lse`` and ``h`` are the forward's row results,
    ``g_logp`` and ``g_h`` the incoming row gradients (``g_h``, ``h`` unused without
    ``WITH_ENTROPY``). Where p underflows to 0 the entropy term is 0 (not 0 * -inf).
    """
    logp = z - lse
    p = tl.exp(logp)
    grad = tl.where(is_label, g_logp, 0.0) - g_logp * p
    if WITH_ENTROPY:
        grad -= tl.where(p > 0.0, g_h * p * (logp + h), 0.0)
    return grad * inv_temperature


#: Helpers only (inlined into the kernels of logprobs.py and linear_logprobs.py, compiled with
#: their variants): no launchable kernel of their own.
AOT_VARIANTS: list = []
