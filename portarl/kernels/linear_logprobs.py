"""Triton kernels of the fused linear log-probs (``portarl.ops.linear_logprobs``).

Design (Liger-Kernel's fused linear cross-entropy, flash-attention's Triton cross-entropy):
the host walks the rows in chunks whose fp32 logits tile [n, V] fits the
``PORTARL_CHUNK_ELEMENTS`` budget;

- :func:`linear_tile_kernel` computes C (+)= (A @ B + bias) * scale in fp32 for the logits
  tile and for the two backward contractions (grad_hidden = grad_z @ W, grad_W += grad_z.T
  @ h), with a tile and a ``DOT`` mode per dtype pair (:func:`tile_config`);
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

Numerics of the tile product (the op's contract: fp32 sums of exact products of the
inputs' values, whatever the input dtype):

- bf16 x bf16, fp16 x fp16 (the logits tile of a 16-bit model): the operands go to the
  tensor cores as they are (``DOT_NATIVE``: wgmma / HGMMA on sm_90, HMMA on sm_80), with an
  fp32 accumulator. The product of two bf16 (8-bit significands) or two fp16 (11-bit) values
  is exact in fp32, so nothing changes against the former fp32 FMA tile but the order of the
  fp32 additions (the tensor cores add a k-group's products before rounding, an fp32-sized
  error within ``FP32_ACCUM_ATOL``).
- fp32 grad_z x bf16 / fp16 weight or hidden (the backward contractions): grad_z is split
  in the kernel into three bf16 pieces, hi + mid + lo == grad_z exactly (:func:`_split3`:
  3 x 8 bits cover fp32's 24), and an fp16 operand into two (8 + 8 >= 11 bits); each product
  of two bf16 pieces is exact in fp32, and the three (bf16) or six (fp16) tensor-core
  products are summed in the fp32 accumulator. So the contract holds unchanged, on the
  tensor cores instead of the FMA units. Only bf16 MMAs: tf32 is not an input precision of
  triton-ascend (its ``tl.dot`` takes ``ieee`` and ``hf32``), and the kernels are shared with
  the Ascend ``triton`` backend. Rejected: casting grad_z to the
  weight dtype, as Liger and eager bf16 autograd do (one MMA): it rounds every term to
  2**-9 relative, against ``FP32_ACCUM_ATOL`` = 1e-5 of the tolerances, i.e. another
  contract; ``input_precision="tf32x3"`` (triton 3.6 and 3.9 have it): near-fp32 but not
  exact (it drops the small x small term and truncates), the interpreter ignores
  ``input_precision`` so CI could not check it (the split is checked under the interpreter
  piece for piece), and triton-ascend lacks it; the fp32 FMA tile, bigger: compiled for
  sm_90 (fp32 x bf16, ``ieee``) it spills at every size tried, 128x128x32 / 8 warps 1776
  bytes of stack, 64x128x32 408, 64x64x32 / 4 warps 432 (the 32x64x32 tile did 6 TFLOP/s
  of 777 on the H200).
- fp32 x fp32 (an fp32 model): fp32 operands and ``input_precision="ieee"`` on the FMA
  units, the 32 x 64 x 32 tile; no tensor-core path yet (staying exact would take nine
  bf16 products per step, three x three pieces).

Tiles (:data:`_TILES`): 128 x 128 x 64 (16-bit operands), 128 x 128 x 32 (fp32 x bf16) and
128 x 64 x 32 (fp32 x fp16: 128 x 128 spilled on sm_80), 8 warps, 3 stages, 64-96 KiB of
shared memory (under the A100's 164 KiB and the H100's 228 KiB), when H and V are
multiples of 16 (:func:`aligned_shape`, true of every real model: 16-byte rows give
vectorized async copies); 64 x 64 x 32, 4 warps, otherwise (element-wise loads: the big
tile would spill). Compiled for sm_90 (HGMMA) and sm_80 (HMMA) without spills, with
triton 3.9 and 3.6 (tests/kernels/test_aot_compile.py); not yet timed on a GPU. A tensor
not 16-byte aligned in memory (a view at an odd offset) gets the same tile, compiled by
the JIT without the divisibility hints: the same numbers, a variant not checked here.

``AOT_VARIANTS`` lists every (signature, constexpr) combination the host code launches,
for ahead-of-time compilation checks (sm_80 / sm_90, no spills, tensor-core SASS), with
the specialization the JIT gives each launch (unit strides as constants; 16-divisible
pointers and sizes where H and V are multiples of 16).
"""

import triton
import triton.language as tl

from portarl.kernels._rowmath import row_grad_inputs, row_lse_entropy, softmax_grad, store_row

#: How linear_tile_kernel feeds its tile product to ``tl.dot`` (see :func:`tile_config`).
DOT_IEEE = tl.constexpr(0)  # fp32 x fp32: fp32 operands, input_precision="ieee" (FMA, no tensor cores)
DOT_NATIVE = tl.constexpr(1)  # bf16 x bf16 or fp16 x fp16: the operands as they are, on the tensor cores
DOT_SPLIT_BF16 = tl.constexpr(2)  # fp32 x bf16: A as three bf16 pieces (exact), three bf16 tensor-core products
DOT_SPLIT_BF16_2 = tl.constexpr(3)  # fp32 x fp16: A in three bf16 pieces, B in two (exact), six bf16 products
#: Row kernels: columns per step; a function of V alone.
MAX_BLOCK_V = 2048


@triton.jit
def _split3(a):
    """fp32 ``a`` = hi + mid + lo exactly, three bf16 pieces.

    hi keeps a's top 8 significant bits (rounded: compiled; truncated: the interpreter,
    exact either way); ``r = a - hi`` is exact in fp32 (at most 16 bits left), mid takes
    its top 8 and ``r - mid`` is exact and fits bf16's 8: 3 x 8 >= 24. bf16 has fp32's
    exponent range, so nothing overflows or flushes but subnormals, far below any tolerance.
    """
    hi = a.to(tl.bfloat16)
    r = a - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _broadcast_dot(a, b):
    """a @ b as fp32 products summed over K in fp32 (the interpreter's tile product)."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _tile_product(a, b, acc, DOT: tl.constexpr, BROADCAST_DOT: tl.constexpr):
    """acc += a @ b for one K step, the products exact and the sums fp32 (see the module doc)."""
    if DOT == DOT_IEEE or DOT == DOT_NATIVE:
        if BROADCAST_DOT:
            acc += _broadcast_dot(a, b)
        elif DOT == DOT_IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    else:
        hi, mid, lo = _split3(a.to(tl.float32))
        if DOT == DOT_SPLIT_BF16:
            b_hi = b
        else:  # fp16 b = b_hi + b_lo exactly: 11 significant bits in two bf16 pieces
            b_hi = b.to(tl.float32).to(tl.bfloat16)
            b_lo = (b.to(tl.float32) - b_hi.to(tl.float32)).to(tl.bfloat16)
        if BROADCAST_DOT:
            acc += _broadcast_dot(hi, b_hi)
            acc += _broadcast_dot(mid, b_hi)
            acc += _broadcast_dot(lo, b_hi)
            if DOT == DOT_SPLIT_BF16_2:
                acc += _broadcast_dot(hi, b_lo)
                acc += _broadcast_dot(mid, b_lo)
                acc += _broadcast_dot(lo, b_lo)
        else:
            acc = tl.dot(hi, b_hi, acc)
            acc = tl.dot(mid, b_hi, acc)
            acc = tl.dot(lo, b_hi, acc)
            if DOT == DOT_SPLIT_BF16_2:
                acc = tl.dot(hi, b_lo, acc)
                acc = tl.dot(mid, b_lo, acc)
                acc = tl.dot(lo, b_lo, acc)
    return acc


@triton.jit
def linear_tile_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, BROADCAST_DOT: tl.constexpr,
):
    """fp32 C[M, N] (+)= (A[M, K] @ B[K, N] + bias[N]) * scale; ``DOT`` from :func:`tile_config`.

    ``BROADCAST_DOT`` (set by the host only under the Triton interpreter): the tile product
    as a broadcast multiply + sum over K, because the interpreter's ``tl.dot`` is a numpy
    (BLAS) matmul whose rounding can depend on a row's position in the tile; compiled
    kernels use ``tl.dot``, where each output element's k-order is fixed by the MMA shape.
    The split modes split A the same way in both.

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
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                        mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = _tile_product(a, b, acc, DOT, BROADCAST_DOT)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        acc = acc * scale
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        c_mask = (rm[:, None] < M) & (rn[None, :] < N)
        if ACCUMULATE:
            acc += tl.load(c_ptrs, mask=c_mask, other=0.0)
        tl.store(c_ptrs, acc, mask=c_mask)


#: (a dtype, b dtype) -> tile of linear_tile_kernel when H and V are multiples of 16 (every
#: real model): 16-byte aligned rows, so the JIT's divisibility specialization gives
#: vectorized async copies (cp.async) into shared memory. Constants per dtype pair, never
#: per row count (batch invariance). fp32 x fp32 keeps the FMA tile.
_TILES = {
    ("fp32", "fp32"): dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, DOT=DOT_IEEE.value, num_warps=8, num_stages=2),
    ("bf16", "bf16"): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, DOT=DOT_NATIVE.value, num_warps=8, num_stages=3),
    ("fp16", "fp16"): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, DOT=DOT_NATIVE.value, num_warps=8, num_stages=3),
    ("fp32", "bf16"): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, DOT=DOT_SPLIT_BF16.value, num_warps=8, num_stages=3),
    ("fp32", "fp16"): dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, DOT=DOT_SPLIT_BF16_2.value, num_warps=8, num_stages=3),
}
#: The same modes on a smaller tile for H or V not a multiple of 16 (element-wise loads
#: through registers: the big tile would spill); the fp32 FMA tile without software
#: pipelining there (two stages leave 8 bytes of stack on sm_80, and on 4 warps on sm_90).
_SMALL = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)


def tile_config(a_dtype: str, b_dtype: str, aligned: bool = True) -> dict:
    """Block sizes, ``DOT`` mode, ``num_warps``, ``num_stages`` of :func:`linear_tile_kernel`
    for triton dtype names (``"fp32"``, ``"bf16"``, ``"fp16"``) of A and B, and whether H and
    V are multiples of 16 (:func:`aligned_shape`); shared by the host
    (:mod:`portarl.backends.cuda.linear_logprobs`) and :data:`AOT_VARIANTS`."""
    try:
        config = dict(_TILES[(a_dtype, b_dtype)])
    except KeyError:
        raise TypeError(f"linear_tile_kernel: no tile for A {a_dtype} x B {b_dtype}; "
                        "A is the model dtype or fp32, B the model dtype") from None
    if not aligned:
        config.update(_SMALL if config["DOT"] != DOT_IEEE.value else {"num_stages": 1})
    return config


def aligned_shape(hidden_size: int, vocab: int) -> bool:
    """Whether the big tiles apply: a function of H and V only, so every chunk of a pass (and
    every batch) gets the same tile."""
    return hidden_size % 16 == 0 and vocab % 16 == 0


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


#: (role, A dtype, B dtype, HAS_BIAS, ACCUMULATE) of every matmul_into launch.
_TILE_LAUNCHES = [launch for d in ("fp32", "bf16", "fp16") for launch in (
    ("logits", d, d, False, False), ("logits", d, d, True, False),  # hidden @ W.T (+ bias)
    ("grad_hidden", "fp32", d, False, False),  # grad_z @ W
    ("grad_weight", "fp32", d, False, True),  # grad_W += grad_z.T @ h
)]
#: The strides that are 1 in each role's launch (contiguous hidden, weight, buffers; the
#: JIT turns an int argument equal to 1 into a constant, so every launch has them).
_UNIT_STRIDES = {"logits": ("stride_ak", "stride_bk", "stride_cn"),
                 "grad_hidden": ("stride_ak", "stride_bn", "stride_cn"),
                 "grad_weight": ("stride_am", "stride_bn", "stride_cn")}
#: The row count of each role (any number): never assumed divisible by 16.
_ROWS = {"logits": "M", "grad_hidden": "M", "grad_weight": "K"}
_INTS = ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn")


def _tile_signature(role, a_t, b_t, aligned):
    """The JIT's specialization of one launch: unit strides as constants, and (``aligned``:
    H and V multiples of 16, as every real model's) 16-divisible pointers and ints, the
    ``tt.divisibility`` attribute the JIT sets; unaligned: none (V 17, H 8 in the tests)."""
    unit = {k: 1 for k in _UNIT_STRIDES[role]}
    # Python ints below 2**31 launch as i32 (triton's mangle_type): every size or stride here.
    sig = {"a_ptr": f"*{a_t}", "b_ptr": f"*{b_t}", "bias_ptr": f"*{b_t}", "c_ptr": "*fp32",
           **{k: "constexpr" if k in unit else "i32" for k in _INTS}, "scale": "fp32",
           **{k: "constexpr" for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "DOT", "HAS_BIAS", "ACCUMULATE",
                                       "BROADCAST_DOT")}}
    attrs = {}
    if aligned:
        attrs = {k: "D" for k in ("a_ptr", "b_ptr", "bias_ptr", "c_ptr", *_INTS) if k not in unit and k != _ROWS[role]}
    return sig, unit, attrs


def _variants():
    out = []
    for role, a_t, b_t, has_bias, acc in _TILE_LAUNCHES:
        for aligned in (True, False):
            config = tile_config(a_t, b_t, aligned)
            warps, stages = config.pop("num_warps"), config.pop("num_stages")
            sig, unit, attrs = _tile_signature(role, a_t, b_t, aligned)
            out.append({"kernel": linear_tile_kernel, "signature": sig, "attrs": attrs,
                        "constexprs": {**unit, **config, "HAS_BIAS": has_bias, "ACCUMULATE": acc,
                                       "BROADCAST_DOT": False},
                        "num_warps": warps, "num_stages": stages})
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
