"""Triton kernels of the fused linear log-probs (``portarl.ops.linear_logprobs``).

Design (Liger-Kernel's fused linear cross-entropy, flash-attention's Triton cross-entropy):
the host walks the rows in chunks whose fp32 logits tile [n, V] fits the
``PORTARL_CHUNK_ELEMENTS`` budget;

- :func:`linear_tile_kernel` computes C (+)= (A @ B + bias) * scale with fp32 loads and an
  fp32 ``tl.dot`` (``input_precision="ieee"``: no TF32), for the logits tile and for the
  two backward contractions (grad_hidden = grad_z @ W, grad_W += grad_z.T @ h);
- :func:`tile_logprobs_forward_kernel` reduces each tile row with the online logsumexp and
  max-relative entropy of :func:`portarl.kernels._rowmath.row_lse_entropy`, the same code
  the ``logprobs`` kernels run;
- :func:`tile_logprobs_backward_kernel` overwrites the recomputed tile with its own
  gradient (:func:`portarl.kernels._rowmath.softmax_grad`, shared with ``logprobs``), in
  place (the chunk's logits buffer is reused for its gradient).

Grids are persistent (:mod:`portarl.backends.cuda.grid`): at most ``MAX_PROGRAMS`` programs
(Ascend refuses more than 65535), each looping over the tiles or rows ``pid, pid +
programs, ...``; every tile and row is computed by one program exactly as before, so the
grid size changes no result.

Batch invariance: an output element of :func:`linear_tile_kernel` is a sum over K in
BLOCK_K steps in a fixed order, and the block sizes are constants, so a row's logits do
not depend on how many rows share its chunk or which; the row kernels walk a row in tiles
that depend on V only. So a row's logp and entropy are bitwise the same whatever the other
rows and the chunking.

``AOT_VARIANTS`` lists every (signature, constexpr) combination the host code launches,
for ahead-of-time compilation checks (sm_80 / sm_90, no spills).
"""

import triton
import triton.language as tl

from portarl.kernels._rowmath import row_grad_inputs, row_lse_entropy, softmax_grad, store_row

#: Tiles of linear_tile_kernel: constants (batch invariance), small enough not to spill.
BLOCK_M = 32
BLOCK_N = 64
BLOCK_K = 32
TILE_WARPS = 8
TILE_STAGES = 2
#: Row kernels: columns per step; a function of V alone.
MAX_BLOCK_V = 2048


@triton.jit
def linear_tile_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, BROADCAST_DOT: tl.constexpr,
):
    """fp32 C[M, N] (+)= (A[M, K] @ B[K, N] + bias[N]) * scale, inputs of any float dtype.

    ``BROADCAST_DOT`` (set by the host only under the Triton interpreter): the tile product
    as a broadcast multiply + sum over K, because the interpreter's ``tl.dot`` is a numpy
    (BLAS) matmul whose rounding can depend on a row's position in the tile; compiled
    kernels use ``tl.dot``, where each output element's k-order is fixed by the MMA shape.

    Tiles (m, n) in the order of the former 2-D grid (m fastest), ``pid, pid + programs,
    ...`` per program.
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    for tile in range(tl.program_id(0), tiles_m * tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        pid_m = tl.cast(tile % tiles_m, tl.int64)
        pid_n = tl.cast(tile // tiles_m, tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0).to(tl.float32)
            b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                        mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0).to(tl.float32)
            if BROADCAST_DOT:
                acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
            else:
                acc = tl.dot(a, b, acc, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        acc = acc * scale
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        c_mask = (rm[:, None] < M) & (rn[None, :] < N)
        if ACCUMULATE:
            acc += tl.load(c_ptrs, mask=c_mask, other=0.0)
        tl.store(c_ptrs, acc, mask=c_mask)


@triton.jit
def tile_logprobs_forward_kernel(
    z_ptr, labels_ptr, logp_ptr, entropy_ptr, lse_ptr, n_rows, n_cols, ignore_index,
    BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    """The rows ``pid, pid + programs, ...`` of a contiguous fp32 [n_rows, V] tile of logits
    already divided by T."""
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        label = tl.load(labels_ptr + row)
        row_ptr = z_ptr + row * n_cols
        if label == ignore_index:
            store_row(row, 0.0, 0.0, 0.0, logp_ptr, lse_ptr, entropy_ptr, WITH_ENTROPY)
        else:
            lse, entropy = row_lse_entropy(row_ptr, 1, n_cols, 1.0, BLOCK_V, WITH_ENTROPY)
            store_row(row, tl.load(row_ptr + label) - lse, lse, entropy, logp_ptr, lse_ptr, entropy_ptr, WITH_ENTROPY)


@triton.jit
def tile_logprobs_backward_kernel(
    z_ptr, labels_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    n_rows, n_cols, inv_temperature, ignore_index,
    BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    """In place: the fp32 tile of z = logits / T becomes d loss / d logits (rows ``pid,
    pid + programs, ...``).

    grad = (g_logp (onehot - p) - g_H p (log p + H)) / T; ignored rows get 0.
    """
    cols = tl.arange(0, BLOCK_V)
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        label = tl.load(labels_ptr + row)
        row_ptr = z_ptr + row * n_cols
        if label == ignore_index:
            for start in range(0, n_cols, BLOCK_V):
                idx = start + cols
                tl.store(row_ptr + idx, tl.zeros([BLOCK_V], dtype=tl.float32), mask=idx < n_cols)
        else:
            lse, g_logp, g_h, h = row_grad_inputs(row, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
                                                  WITH_ENTROPY)
            for start in range(0, n_cols, BLOCK_V):
                idx = start + cols
                in_row = idx < n_cols
                z = tl.load(row_ptr + idx, mask=in_row, other=-float("inf"))
                grad = softmax_grad(z, idx == label, lse, g_logp, g_h, h, inv_temperature, WITH_ENTROPY)
                tl.store(row_ptr + idx, grad, mask=in_row)


#: Row kernels' pipeline stages (a row longer than its tile prefetches the next one).
ROW_STAGES = 2
#: Every row tile :func:`row_config` can return: 16 .. MAX_BLOCK_V columns.
ROW_BLOCKS = [16 << i for i in range((MAX_BLOCK_V // 16).bit_length())]


def row_config(n_cols: int) -> dict:
    """``BLOCK_V``, ``num_warps``, ``num_stages`` of both row kernels for a vocabulary of ``n_cols``.

    A function of V only (batch invariance), shared by the host
    (:mod:`portarl.backends.cuda.linear_logprobs`) and :data:`AOT_VARIANTS`.
    """
    block = min(MAX_BLOCK_V, max(16, triton.next_power_of_2(n_cols)))
    return {"BLOCK_V": block, "num_warps": 8 if block >= 2048 else 4, "num_stages": ROW_STAGES}


def _variants():
    out = []
    dtypes = ("*fp32", "*bf16", "*fp16")
    # Python ints below 2**31 launch as i32 (triton's mangle_type), and every size or stride
    # here is one (V, H, rows per chunk); the AOT build compiles what the JIT would.
    ints = {k: "i32" for k in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm",
                              "stride_cn")}
    combos = []  # (a, b, HAS_BIAS, ACCUMULATE) as launched by the host
    for d in dtypes:
        combos += [(d, d, False, False), (d, d, True, False)]  # logits tile = hidden @ W.T (+ bias)
        combos += [("*fp32", d, False, False), ("*fp32", d, False, True)]  # grad_z @ W, grad_W += grad_z.T @ h
    for a_t, b_t, has_bias, acc in dict.fromkeys(combos):
        sig = {"a_ptr": a_t, "b_ptr": b_t, "bias_ptr": b_t, "c_ptr": "*fp32", **ints, "scale": "fp32",
               "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
               "HAS_BIAS": "constexpr", "ACCUMULATE": "constexpr", "BROADCAST_DOT": "constexpr"}
        out.append({"kernel": linear_tile_kernel, "signature": sig,
                    "constexprs": {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K,
                                   "HAS_BIAS": has_bias, "ACCUMULATE": acc, "BROADCAST_DOT": False},
                    "num_warps": TILE_WARPS, "num_stages": TILE_STAGES})
    for block in ROW_BLOCKS:
        config = row_config(block)
        for ent in (False, True):
            out.append({"kernel": tile_logprobs_forward_kernel,
                        "signature": {"z_ptr": "*fp32", "labels_ptr": "*i64", "logp_ptr": "*fp32",
                                      "entropy_ptr": "*fp32", "lse_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32",
                                      "ignore_index": "i32", "BLOCK_V": "constexpr", "WITH_ENTROPY": "constexpr"},
                        "constexprs": {"BLOCK_V": block, "WITH_ENTROPY": ent},
                        "num_warps": config["num_warps"], "num_stages": config["num_stages"]})
            out.append({"kernel": tile_logprobs_backward_kernel,
                        "signature": {"z_ptr": "*fp32", "labels_ptr": "*i64", "lse_ptr": "*fp32",
                                      "entropy_ptr": "*fp32", "grad_logp_ptr": "*fp32", "grad_entropy_ptr": "*fp32",
                                      "n_rows": "i32", "n_cols": "i32", "inv_temperature": "fp32", "ignore_index": "i32",
                                      "BLOCK_V": "constexpr", "WITH_ENTROPY": "constexpr"},
                        "constexprs": {"BLOCK_V": block, "WITH_ENTROPY": ent},
                        "num_warps": config["num_warps"], "num_stages": config["num_stages"]})
    return out


#: Every (signature, constexprs, launch config) the host code (backends/cuda/linear_logprobs.py) launches.
AOT_VARIANTS = _variants()
