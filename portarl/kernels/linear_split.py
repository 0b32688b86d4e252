"""Triton kernels of the split-vocabulary fused linear log-probs (the ``split`` head of
:mod:`portarl.backends.cuda.linear_heads`).

Why: the chunked head (:mod:`portarl.kernels.linear_logprobs`) writes each row chunk's fp32
logits tile [n, V] to memory and reads it back in a row kernel; a chunk of n rows re-reads
the whole weight, and the tile product runs on small tiles. The fast heads that are also
batch invariant (verl's Triton head, RL-Kernel's split ``linear_logp``; shared notes
``gpu-linear-logprobs.md``) share one design, which this module follows:

- the vocabulary is cut into splits of :func:`split_config`'s ``SPLIT`` columns, a
  function of V and the dtypes only;
- a 2-D grid of (row tile, split) items, the row-tile index varying fastest, so the row
  tiles that read the same weight slice run at the same time (the slice is read from HBM
  about once and served from L2 to the others);
- each item computes its logits [BLOCK_M, BLOCK_N] a sub-tile at a time (the tile product
  of :func:`portarl.kernels.linear_logprobs._tile_product`: exact products, fp32 sums, the
  K order fixed by BLOCK_K) and folds them into per-row fp32 partials: the running max m,
  s = sum exp(z - m), t = sum exp(z - m) (z - m) (entropy) and the label's logit;
- :func:`split_merge_kernel` merges a row's partials in split order (a fixed tree over at
  most ``MAX_SPLITS`` values) into lse, logp and entropy. No atomics, no locks.

So a row's result is a function of its own hidden state, the weight, V and the dtypes: the
same bits whatever the other rows of its batch and wherever it sits (the invariance gate,
tests/parity/test_linear_heads.py). Nothing N x V is ever written: the partials are
[N, splits, 4] fp32 (4096 rows x 149 splits of V 151,936: 9.8 MB).

Backward (:func:`split_grad_logits_kernel`): the same (row tile, split) items recompute the
logits sub-tiles and write d loss / d logits straight into the chunk's fp32 gradient buffer
(:func:`portarl.kernels._rowmath.softmax_grad`: one pass instead of a logits write, a read
and an in-place rewrite); the host then contracts it with the weight and the hidden states
(:func:`portarl.backends.cuda.linear_logprobs.matmul_into`), as the chunked head does.

The numbers differ from the chunked head's by the order of the fp32 row sums (sub-tiles of
``BLOCK_N`` merged per split, then splits merged, against tiles of ``MAX_BLOCK_V``): within
the op's contract (``portarl.parity.tolerances``), checked against float64.
"""

import triton
import triton.language as tl

from portarl.kernels._rowmath import softmax_grad
from portarl.kernels.linear_logprobs import (
    DOT_IEEE,
    _tile_product,
    tile_config,
)

#: Most splits a row may have (the merge kernel holds them in one block): V up to
#: MAX_SPLITS x SPLIT, 262,144 columns at the largest split.
MAX_SPLITS = 256
#: Columns per split on the tensor-core tiles (verl's 1024): a constant, never a function of N.
SPLIT_COLUMNS = 1024


#: (16-bit operands?, aligned?) -> the tile of each split kernel: the largest without spills
#: in the sm_80 and sm_90 ahead-of-time compiles (tests/kernels/test_aot_compile.py). The
#: forward: 128 x 128 spilled 120 bytes on sm_90, 128 x 64 none; the gradient, which holds
#: the softmax gradient's temporaries beside the tile, spilled 152 bytes at 64 x 128 on
#: sm_80 and takes 64 x 64. BLOCK_K (which fixes the order of each logit's K sum) is the
#: same in both, so the gradient recomputes the forward's logits.
_FORWARD_TILES = {
    (True, True): dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    (True, False): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=2),
    (False, True): dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=1),
    (False, False): dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=1),
}
_GRAD_TILES = {
    (True, True): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
    (True, False): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=2),
    (False, True): dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=1),
    (False, False): dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=1),
}


def split_config(a_dtype: str, b_dtype: str, vocab: int, aligned: bool = True, kernel: str = "forward") -> dict:
    """A split kernel's (``kernel``: ``"forward"`` or ``"grad"``) tile and split for dtype names
    (``"fp32"``, ``"bf16"``, ``"fp16"``) of hidden and weight, a vocabulary of ``vocab`` and
    :func:`aligned_shape` of H and V: the tile product's ``DOT`` mode (:func:`tile_config`),
    the tile of :data:`_FORWARD_TILES` / :data:`_GRAD_TILES`, and ``SPLIT``, a multiple of
    the forward's BLOCK_N (hence of the gradient's) that depends on V only (enough splits
    for a small V to still spread over the grid, at most :data:`MAX_SPLITS`)."""
    key = (a_dtype != "fp32", aligned)
    config = {"DOT": tile_config(a_dtype, b_dtype, aligned)["DOT"],
              **(_FORWARD_TILES if kernel == "forward" else _GRAD_TILES)[key]}
    block_n = _FORWARD_TILES[key]["BLOCK_N"]
    split = max(block_n, min(SPLIT_COLUMNS, block_n * triton.cdiv(triton.cdiv(vocab, 8), block_n)))
    while triton.cdiv(vocab, split) > MAX_SPLITS:
        split *= 2
    config["SPLIT"] = split
    return config


def n_splits(vocab: int, split: int) -> int:
    return triton.cdiv(vocab, split)


@triton.jit
def _logits_subtile(h_ptr, w_ptr, bias_ptr, rm, rn, M, V, K, stride_hm, stride_hk, stride_wv, stride_wk, inv_t,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BROADCAST_DOT: tl.constexpr):
    """fp32 z[BLOCK_M, BLOCK_N] = (h[rm] @ w[rn].T + bias[rn]) * inv_t; columns >= V are -inf."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(h_ptr + rm[:, None] * stride_hm + kk[None, :] * stride_hk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wv,
                    mask=(kk[:, None] < K) & (rn[None, :] < V), other=0.0)
        acc = _tile_product(a, b, acc, DOT, BROADCAST_DOT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < V, other=0.0).to(tl.float32)[None, :]
    acc = acc * inv_t
    return tl.where((rn < V)[None, :], acc, -float("inf"))


@triton.jit(do_not_specialize=["M"])
def split_forward_kernel(
    h_ptr, w_ptr, bias_ptr, labels_ptr, part_ptr,
    M, V, K, stride_hm, stride_hk, stride_wv, stride_wk, inv_t, split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, BROADCAST_DOT: tl.constexpr,
):
    """Per (row, split) fp32 partials ``part[row, split] = (m, s, t, z_label)`` of the logits
    ``z = (h @ w.T + bias) * inv_t``: the split's max m, s = sum exp(z - m), t = sum
    exp(z - m) (z - m) (0 without ``WITH_ENTROPY``), and the label's logit if the label
    falls in the split (else 0: exactly one split holds it, the merge sums them).

    Items ``(row tile, split)``, the row tile fastest, ``pid, pid + programs, ...`` per
    program (a persistent grid). ``part`` is contiguous [M, splits, 4]. ``split`` (columns
    per split, a multiple of BLOCK_N) is an argument, not a constant: one compiled kernel
    per tile serves every V; M is never specialised (a kernel compiled for M = 1, or for M
    divisible by 16, must not be another kernel: the same bits for every batch).
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    splits = tl.cdiv(V, split)
    cols = tl.arange(0, BLOCK_N)
    for item in range(tl.program_id(0), tiles_m * splits, tl.num_programs(0)):
        pid_m = tl.cast(item % tiles_m, tl.int64)
        pid_s = tl.cast(item // tiles_m, tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        in_rows = rm < M
        label = tl.load(labels_ptr + rm, mask=in_rows, other=-1)
        m = tl.full([BLOCK_M], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK_M], dtype=tl.float32)
        t = tl.zeros([BLOCK_M], dtype=tl.float32)
        z_label = tl.zeros([BLOCK_M], dtype=tl.float32)
        for n0 in range(0, split, BLOCK_N):
            rn = pid_s * split + n0 + cols
            z = _logits_subtile(h_ptr, w_ptr, bias_ptr, rm, rn, M, V, K, stride_hm, stride_hk, stride_wv, stride_wk,
                                inv_t, BLOCK_M, BLOCK_N, BLOCK_K, DOT, HAS_BIAS, BROADCAST_DOT)
            z_label += tl.sum(tl.where(rn[None, :] == label[:, None], z, 0.0), axis=1)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            # all entries so far -inf: shift by 0 so exp() sees -inf, not nan (-inf - -inf)
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            e = tl.exp(z - shift[:, None])
            scale = tl.exp(m - shift)
            s_prev = s
            s = s * scale + tl.sum(e, axis=1)
            if WITH_ENTROPY:
                tile_t = tl.sum(tl.where(e > 0.0, e * (z - shift[:, None]), 0.0), axis=1)
                moved = tl.where(s_prev > 0.0, (m - shift) * s_prev, 0.0)
                t = scale * (t + moved) + tile_t
            m = m_new
        base = part_ptr + (rm * splits + pid_s) * 4
        tl.store(base, m, mask=in_rows)
        tl.store(base + 1, s, mask=in_rows)
        tl.store(base + 2, t, mask=in_rows)
        tl.store(base + 3, z_label, mask=in_rows)


@triton.jit(do_not_specialize=["M"])
def split_merge_kernel(
    part_ptr, labels_ptr, logp_ptr, lse_ptr, entropy_ptr, M, splits, ignore_index,
    BLOCK_S: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    """Rows ``pid, pid + programs, ...``: merge the row's ``splits`` partials (a fixed tree
    over BLOCK_S >= splits values: the same for every row) into ``lse``, ``logp = z_label
    - lse`` and ``entropy = log s - t / s``; an ignored row stores 0.0 for each."""
    idx = tl.arange(0, BLOCK_S)
    live = idx < splits
    for r in range(tl.program_id(0), M, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        label = tl.load(labels_ptr + row)
        base = part_ptr + (row * splits + idx) * 4
        m_i = tl.load(base, mask=live, other=-float("inf"))
        s_i = tl.load(base + 1, mask=live, other=0.0)
        z_label = tl.sum(tl.load(base + 3, mask=live, other=0.0), axis=0)
        m = tl.max(m_i, axis=0)
        shift = tl.where(m == -float("inf"), 0.0, m)
        # splits past V: m_i -inf and s_i 0, so scale 0; a NaN in s_i (a NaN logit) survives
        scale = tl.exp(m_i - shift)
        s = tl.sum(tl.where(s_i == 0.0, 0.0, s_i * scale), axis=0)
        log_s = tl.log(s)
        lse = shift + log_s
        if label == ignore_index:
            tl.store(logp_ptr + row, 0.0)
            tl.store(lse_ptr + row, 0.0)
            if WITH_ENTROPY:
                tl.store(entropy_ptr + row, 0.0)
        else:
            tl.store(logp_ptr + row, z_label - lse)
            tl.store(lse_ptr + row, lse)
            if WITH_ENTROPY:
                t_i = tl.load(base + 2, mask=live, other=0.0)
                # sum over the split of e^(z - shift) (z - shift) = scale (t_i + (m_i - shift) s_i)
                t = tl.sum(tl.where(s_i == 0.0, 0.0, scale * (t_i + (m_i - shift) * s_i)), axis=0)
                tl.store(entropy_ptr + row, log_s - t / s)


@triton.jit(do_not_specialize=["M"])
def split_grad_logits_kernel(
    h_ptr, w_ptr, bias_ptr, labels_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, g_ptr,
    M, V, K, stride_hm, stride_hk, stride_wv, stride_wk, stride_gm, inv_t, ignore_index, split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, BROADCAST_DOT: tl.constexpr,
):
    """fp32 ``g[row, col]`` = d(g_logp logp + g_H H) / d logits of the rows ``[0, M)``
    (the chunk's, pointers already offset), recomputing each logits sub-tile on the same
    (row tile, split) items as the forward; ignored rows get 0. ``g`` has unit column stride."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    splits = tl.cdiv(V, split)
    cols = tl.arange(0, BLOCK_N)
    for item in range(tl.program_id(0), tiles_m * splits, tl.num_programs(0)):
        pid_m = tl.cast(item % tiles_m, tl.int64)
        pid_s = tl.cast(item // tiles_m, tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        in_rows = rm < M
        label = tl.load(labels_ptr + rm, mask=in_rows, other=ignore_index)
        keep = in_rows & (label != ignore_index)
        lse = tl.load(lse_ptr + rm, mask=in_rows, other=0.0)
        g_logp = tl.load(grad_logp_ptr + rm, mask=in_rows, other=0.0)
        g_h = tl.zeros([BLOCK_M], dtype=tl.float32)
        h = tl.zeros([BLOCK_M], dtype=tl.float32)
        if WITH_ENTROPY:
            g_h = tl.load(grad_entropy_ptr + rm, mask=in_rows, other=0.0)
            h = tl.load(entropy_ptr + rm, mask=in_rows, other=0.0)
        for n0 in range(0, split, BLOCK_N):
            rn = pid_s * split + n0 + cols
            z = _logits_subtile(h_ptr, w_ptr, bias_ptr, rm, rn, M, V, K, stride_hm, stride_hk, stride_wv, stride_wk,
                                inv_t, BLOCK_M, BLOCK_N, BLOCK_K, DOT, HAS_BIAS, BROADCAST_DOT)
            grad = softmax_grad(z, rn[None, :] == label[:, None], lse[:, None], g_logp[:, None], g_h[:, None],
                                h[:, None], inv_t, WITH_ENTROPY)
            grad = tl.where(keep[:, None], grad, 0.0)
            tl.store(g_ptr + rm[:, None] * stride_gm + rn[None, :], grad, mask=in_rows[:, None] & (rn < V)[None, :])


def _variants():
    """Every (signature, constexprs, launch config) the host launches (``linear_heads``):
    three dtypes x bias x entropy for the two tile kernels, aligned or not, and the merge."""
    out = []
    ints = ("M", "V", "K", "stride_hm", "stride_hk", "stride_wv", "stride_wk")
    tile_keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "DOT")
    for d in ("fp32", "bf16", "fp16"):
        for aligned in (True, False):
            configs = {}
            for kernel in ("forward", "grad"):
                config = split_config(d, d, 151_936 if aligned else 4099, aligned, kernel)
                configs[kernel] = ({k: config[k] for k in tile_keys}, config["num_warps"], config["num_stages"])
            unit = {"stride_hk": 1, "stride_wk": 1}
            attrs = {k: "D" for k in ("h_ptr", "w_ptr", "bias_ptr", "V", "K", "stride_wv") if aligned}
            for has_bias in (False, True):
                for ent in (False, True):
                    flags = {"HAS_BIAS": has_bias, "WITH_ENTROPY": ent, "BROADCAST_DOT": False}
                    tile, warps, stages = configs["forward"]
                    common = {**unit, **tile, **flags}
                    sig = {"h_ptr": f"*{d}", "w_ptr": f"*{d}", "bias_ptr": f"*{d}", "labels_ptr": "*i64",
                           "part_ptr": "*fp32", **{k: "constexpr" if k in unit else "i32" for k in ints},
                           "inv_t": "fp32", "split": "i32",
                           **{k: "constexpr" for k in (*tile_keys, "HAS_BIAS", "WITH_ENTROPY", "BROADCAST_DOT")}}
                    out.append({"kernel": split_forward_kernel, "signature": sig, "attrs": attrs, "constexprs": common,
                                "num_warps": warps, "num_stages": stages})
                    gsig = {"h_ptr": f"*{d}", "w_ptr": f"*{d}", "bias_ptr": f"*{d}", "labels_ptr": "*i64",
                            "lse_ptr": "*fp32", "entropy_ptr": "*fp32", "grad_logp_ptr": "*fp32",
                            "grad_entropy_ptr": "*fp32", "g_ptr": "*fp32",
                            **{k: "constexpr" if k in unit else "i32" for k in (*ints, "stride_gm")},
                            "inv_t": "fp32", "ignore_index": "i32", "split": "i32",
                            **{k: "constexpr" for k in (*tile_keys, "HAS_BIAS", "WITH_ENTROPY", "BROADCAST_DOT")}}
                    tile, warps, stages = configs["grad"]
                    out.append({"kernel": split_grad_logits_kernel, "signature": gsig, "attrs": attrs,
                                "constexprs": {**unit, **tile, **flags}, "num_warps": warps, "num_stages": stages})
    for ent in (False, True):
        out.append({"kernel": split_merge_kernel,
                    "signature": {"part_ptr": "*fp32", "labels_ptr": "*i64", "logp_ptr": "*fp32", "lse_ptr": "*fp32",
                                  "entropy_ptr": "*fp32", "M": "i32", "splits": "i32", "ignore_index": "i32",
                                  "BLOCK_S": "constexpr", "WITH_ENTROPY": "constexpr"},
                    "constexprs": {"BLOCK_S": MAX_SPLITS, "WITH_ENTROPY": ent}, "num_warps": 4, "num_stages": 1})
    return out


#: Every (signature, constexprs, launch config) the host code launches, for the ahead-of-time
#: compile checks (tests/kernels/test_aot_compile.py).
AOT_VARIANTS = _variants()
#: The fp32 x fp32 tile keeps the FMA units (DOT_IEEE), as the chunked head's does.
assert split_config("fp32", "fp32", 151_936)["DOT"] == DOT_IEEE.value
