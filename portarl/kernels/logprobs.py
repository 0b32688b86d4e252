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

Launch configurations (tile, warps, pipeline stages) are functions of V alone,
:func:`forward_config` and :func:`backward_config`, shared by the host code and by
:data:`AOT_VARIANTS` (the list the ahead-of-time compile test builds for sm_80 / sm_90).

The backward, :func:`logprobs_grad_kernel`, works on (row, column block) items: with lse
and H saved by the forward, every gradient element is independent, so a long row is
spread over many programs instead of one program walking V serially.

Grids are persistent (:mod:`portarl.kernels.grid`): a launch has at most ``MAX_PROGRAMS``
programs (Ascend refuses more than 65535), and each program loops over the rows (items)
``pid, pid + programs, ...``. A row is still computed by one program with the same
operations in the same order, so the results do not depend on the grid size (bitwise). With
``IN_PLACE`` it writes the gradient over the logits it reads (each element is read, then
written, by the one program that owns it), flash-attention's ``inplace_backward`` for its
cross-entropy and Liger's reuse of the logits buffer: a caller that owns a logits chunk
(a fused linear log-prob op) gets its gradient without a second N x V buffer.

The row walk and the per-element gradient are :mod:`portarl.kernels._rowmath`'s
:func:`row_lse_entropy` and :func:`softmax_grad`, shared with the fused linear log-probs
kernels. Entropy is accumulated relative to the running maximum m:
    s = sum exp(z - m),  t = sum exp(z - m) * (z - m),  H = log(s) - t / s
which keeps both terms O(log V) even for logits of magnitude 1e4 (accumulating
sum p * z directly would cancel two numbers of size |z|).
"""

import triton
import triton.language as tl

from portarl.kernels._rowmath import row_grad_inputs, row_lse_entropy, softmax_grad, store_row
from portarl.kernels.rounding import cast_for_store

#: Largest forward tile of a row held at once (columns).
MAX_BLOCK_V = 4096
#: Largest backward column block (one per program of the 2-D grid).
MAX_BLOCK_BWD = 2048
MIN_BLOCK = 16


def _pow2_block(n_cols: int, cap: int) -> int:
    return min(cap, max(MIN_BLOCK, triton.next_power_of_2(max(1, n_cols))))


def _warps(block: int) -> int:
    """One warp per 256 columns, 1 to 8: 8 to 16 fp32 values per thread at most."""
    return max(1, min(8, block // 256))


def forward_config(n_cols: int) -> dict:
    """``BLOCK_V``, ``num_warps``, ``num_stages`` of the forward for a vocabulary of ``n_cols``.

    A function of V only: the tile order, hence every floating-point operation of a row, is
    the same whatever the batch (bitwise batch invariance). A row that fits one tile has no
    loop to pipeline (1 stage); longer rows prefetch the next tile (2 stages).
    """
    block = _pow2_block(n_cols, MAX_BLOCK_V)
    return {"BLOCK_V": block, "num_warps": _warps(block), "num_stages": 1 if n_cols <= block else 2}


def backward_config(n_cols: int) -> dict:
    """``BLOCK_V``, ``num_warps``, ``num_stages`` of the 2-D backward (one tile per program)."""
    block = _pow2_block(n_cols, MAX_BLOCK_BWD)
    return {"BLOCK_V": block, "num_warps": _warps(block), "num_stages": 1}


@triton.jit
def logprobs_forward_kernel(
    logits_ptr,
    row_offsets_ptr,
    col_stride,
    labels_ptr,
    logp_ptr,
    entropy_ptr,
    lse_ptr,
    n_rows,
    n_cols,
    inv_temperature,
    ignore_index,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    """Rows ``pid, pid + programs, ...`` of ``n_rows`` (a persistent grid)."""
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        label = tl.load(labels_ptr + row)
        row_ptr = logits_ptr + tl.load(row_offsets_ptr + row)
        if label == ignore_index:
            store_row(row, 0.0, 0.0, 0.0, logp_ptr, lse_ptr, entropy_ptr, WITH_ENTROPY)
        else:
            lse, entropy = row_lse_entropy(row_ptr, col_stride, n_cols, inv_temperature, BLOCK_V, WITH_ENTROPY)
            z_label = tl.load(row_ptr + label * col_stride).to(tl.float32) * inv_temperature
            store_row(row, z_label - lse, lse, entropy, logp_ptr, lse_ptr, entropy_ptr, WITH_ENTROPY)


@triton.jit
def logprobs_grad_kernel(
    logits_ptr,
    row_offsets_ptr,
    col_stride,
    labels_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    grad_logits_ptr,
    n_rows,
    n_cols,
    inv_temperature,
    ignore_index,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    IN_PLACE: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Items (row, column block) of ``n_rows`` x cdiv(V, BLOCK_V), rows fastest (the order of
    the former 2-D grid), ``pid, pid + programs, ...`` per program: grad_z = g_logp *
    (onehot - p) - g_H * p * (log p + H), grad_logits = grad_z / T, one column block per item.

    Not ``IN_PLACE``: ``grad_logits`` is a contiguous [N, V] buffer in the logits' dtype.
    ``IN_PLACE``: the gradient goes over the logits (same offsets and stride);
    ``grad_logits_ptr`` is not used (the host passes a dummy, never the logits twice).
    """
    n_items = n_rows * tl.cdiv(n_cols, BLOCK_V)
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        row = tl.cast(item % n_rows, tl.int64)
        idx = tl.cast(item // n_rows, tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        in_row = idx < n_cols
        label = tl.load(labels_ptr + row)
        row_ptr = logits_ptr + tl.load(row_offsets_ptr + row)
        if label == ignore_index:
            grad = tl.zeros([BLOCK_V], dtype=tl.float32)
        else:
            lse, g_logp, g_h, h = row_grad_inputs(row, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
                                                  WITH_ENTROPY)
            x = tl.load(row_ptr + idx * col_stride, mask=in_row, other=-float("inf"))
            grad = softmax_grad(x.to(tl.float32) * inv_temperature, idx == label, lse, g_logp, g_h, h,
                                inv_temperature, WITH_ENTROPY)
        if IN_PLACE:
            tl.store(row_ptr + idx * col_stride, cast_for_store(grad, logits_ptr, ROUND_BF16), mask=in_row)
        else:
            out_ptr = grad_logits_ptr + row * n_cols
            tl.store(out_ptr + idx, cast_for_store(grad, grad_logits_ptr, ROUND_BF16), mask=in_row)


# ------------------------------------------------------------------ ahead-of-time variants
_ROWS_SIG = {"logits_ptr": "*{dt}", "row_offsets_ptr": "*i64", "col_stride": "i32", "labels_ptr": "*i64"}
_FORWARD_SIG = {**_ROWS_SIG, "logp_ptr": "*fp32", "entropy_ptr": "*fp32", "lse_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32",
                "inv_temperature": "fp32", "ignore_index": "i32", "BLOCK_V": "constexpr", "WITH_ENTROPY": "constexpr"}
_GRAD_SIG = {**_ROWS_SIG, "lse_ptr": "*fp32", "entropy_ptr": "*fp32", "grad_logp_ptr": "*fp32",
             "grad_entropy_ptr": "*fp32", "grad_logits_ptr": "*{dt}", "n_rows": "i32", "n_cols": "i32",
             "inv_temperature": "fp32",
             "ignore_index": "i32", "BLOCK_V": "constexpr", "WITH_ENTROPY": "constexpr", "ROUND_BF16": "constexpr"}

#: Vocabulary sizes that reach every configuration :func:`forward_config` and
#: :func:`backward_config` can return (they depend on next_power_of_2(V) and V > tile only).
CONFIG_VOCABS = [1 << i for i in range(0, 13)] + [MAX_BLOCK_V + 1]


def _variant(kernel, sig, dtype, config, **flags):
    config = dict(config)
    warps, stages = config.pop("num_warps"), config.pop("num_stages")
    signature = {name: sig[name].format(dt=dtype) for name in kernel.arg_names}
    return {"kernel": kernel, "signature": signature, "constexprs": {**config, **flags},
            "num_warps": warps, "num_stages": stages}


def _aot_variants() -> list:
    """Every constexpr / warps / stages combination the host (:mod:`portarl.backends.cuda.logprobs`)
    launches on a GPU, in bf16 (the RL case); fp32 and fp16 logits for the largest tiles.
    ``ROUND_BF16`` is True only under the interpreter; one variant checks that it compiles."""
    variants, seen = [], set()
    largest_fwd, largest_bwd = forward_config(MAX_BLOCK_V + 1), backward_config(MAX_BLOCK_V + 1)
    for v in CONFIG_VOCABS:
        for entropy in (False, True):
            fwd, bwd = forward_config(v), backward_config(v)
            dtypes = ("bf16", "fp32", "fp16") if fwd == largest_fwd else ("bf16",)
            for dt in dtypes:
                key = ("fwd", dt, entropy, tuple(fwd.items()))
                if key not in seen:
                    seen.add(key)
                    variants.append(_variant(logprobs_forward_kernel, _FORWARD_SIG, dt, fwd, WITH_ENTROPY=entropy))
            for in_place in (False, True):
                dtypes = ("bf16", "fp32", "fp16") if bwd == largest_bwd and v > MAX_BLOCK_V else ("bf16",)
                for dt in dtypes:
                    key = ("bwd", dt, entropy, in_place, tuple(bwd.items()))
                    if key in seen:
                        continue
                    seen.add(key)
                    sig = dict(_GRAD_SIG, IN_PLACE="constexpr")
                    if in_place:
                        sig["grad_logits_ptr"] = "*fp32"  # a dummy (lse): never the logits twice
                    variants.append(_variant(logprobs_grad_kernel, sig, dt, bwd, WITH_ENTROPY=entropy,
                                             IN_PLACE=in_place, ROUND_BF16=False))
    variants.append(_variant(logprobs_grad_kernel, dict(_GRAD_SIG, IN_PLACE="constexpr"), "bf16", largest_bwd,
                             WITH_ENTROPY=True, IN_PLACE=False, ROUND_BF16=True))
    return variants


#: Dicts ``{"kernel", "signature", "constexprs", "num_warps", "num_stages"}`` for
#: ``triton.compile`` (tests/kernels/test_aot_compile.py).
AOT_VARIANTS = _aot_variants()
