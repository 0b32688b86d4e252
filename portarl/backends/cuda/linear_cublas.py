"""The ``cublas`` head: cuBLAS GEMMs on fixed-shape row chunks, then portarl's Triton row kernels.

Why: cuBLAS runs the logits GEMM at tensor-core speed, but picks its algorithm (tiles,
split-K) from the shape, M included, so a row's logits can change with the batch it sits
in (TransformerEngine #2986; vLLM's batch-invariant mode). Here every GEMM has the same M:
the rows go in chunks of :func:`fixed_rows` (a function of V and the chunk budget, never of
N), the last chunk padded with zero rows into a buffer of that size. A GEMM of a fixed
shape runs the same algorithm every time, and an output element depends only on its own
row and column, so a row's logits are the same bits whatever the other rows are.

The contract of the op holds (fp32 sums of exact products, as the Triton tiles):

- logits: bf16 / fp16 operands with an fp32 output (``torch.mm(..., out_dtype=float32)``,
  cuBLAS's fp32 accumulation; reduced-precision reductions off for the call); fp32 operands
  with TF32 off (``fp32_precision = "ieee"`` for the call);
- the backward contractions multiply the fp32 logits gradient by bf16 / fp16 weights or
  hidden states: the gradient is split into three bf16 pieces (hi + mid + lo, exact) and an
  fp16 operand into two, and the bf16 GEMMs' fp32 results are summed, exactly as the Triton
  tile's ``DOT_SPLIT_BF16`` modes do (:mod:`portarl.kernels.linear_logprobs`);
- off CUDA (CI under the Triton interpreter) the same pieces are multiplied in fp32 by
  ``torch.mm``: products of bf16 pieces are exact in fp32 there too.

The per-row work between the GEMMs is the chunked head's: ``tile_logprobs_forward_kernel``
and, in place, ``tile_logprobs_backward_kernel`` (:mod:`portarl.backends.cuda.linear_logprobs`).
"""

from __future__ import annotations

import contextlib

import torch

from portarl.backends._linear_chunks import ChunkMath
from portarl.backends.rows import chunk_rows

#: Most rows one fixed chunk holds: past this, a bigger M buys a GEMM little.
MAX_FIXED_ROWS = 4096


def fixed_rows(vocab: int) -> int:
    """Rows of every GEMM of this head: the chunk budget over V, at most MAX_FIXED_ROWS."""
    return chunk_rows(vocab, max_rows=MAX_FIXED_ROWS)


@contextlib.contextmanager
def exact_cuda_matmuls(device: torch.device):
    """TF32 and reduced-precision reductions off for the GEMMs inside (restored after): a
    user's ``torch.set_float32_matmul_precision("high")`` must not change the op's contract."""
    if device.type != "cuda":
        yield
        return
    m = torch.backends.cuda.matmul
    saved = (m.fp32_precision, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    try:
        m.fp32_precision = "ieee"
        m.allow_bf16_reduced_precision_reduction = False
        m.allow_fp16_reduced_precision_reduction = False
        yield
    finally:
        m.fp32_precision, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = saved


def mm32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``a @ b`` (into ``out`` if given) of two same-dtype operands: exact products
    (16-bit operands, or bf16 pieces), fp32 sums."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        if out is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def bf16_pieces(x: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    """fp32 ``x`` as ``pieces`` bf16 tensors summing to it exactly (3 cover fp32's 24
    significant bits, 2 an fp16's 11): each takes the top 8 bits of what is left."""
    out, rest = [], x
    for i in range(pieces):
        piece = rest.to(torch.bfloat16)
        out.append(piece)
        if i + 1 < pieces:
            rest = rest - piece.float()
    return out


def addmm32_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """fp32 ``c += a @ b`` of two same-dtype operands (exact products, fp32 sums); off CUDA
    the product is summed into ``c`` by the BLAS call itself (no weight-sized temporary)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        c.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        c.addmm_(a.float(), b.float())


def mixed_addmm32_(c: torch.Tensor, grad: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """fp32 ``c += grad @ other`` for an fp32 ``grad`` and an fp32 / bf16 / fp16 ``other``, as
    fp32 sums of exact products (bf16 pieces on the tensor cores). Returns ``c``."""
    if other.dtype == torch.float32:
        addmm32_(c, grad, other)
        return c
    right = [other] if other.dtype == torch.bfloat16 else bf16_pieces(other.float(), 2)
    for b in right:
        for a in bf16_pieces(grad, 3):
            addmm32_(c, a, b)
    return c


class FixedChunkMath(ChunkMath):
    """cuBLAS GEMMs of a fixed M (:func:`fixed_rows`), a chunk's rows copied into a
    zero-padded buffer; the row kernels see the chunk's real rows only."""

    fixed_rows = True

    def start(self, step, vocab, device):
        self.step, self.device = step, device
        self.rows_buf = self.gh32 = self.w32 = None
        self.buf = torch.empty(step, vocab, dtype=torch.float32, device=device)
        self.n = 0

    def rows(self, hidden_rows):
        n = hidden_rows.shape[0]
        if self.rows_buf is None:
            self.rows_buf = torch.zeros(self.step, hidden_rows.shape[1], dtype=hidden_rows.dtype, device=self.device)
        self.rows_buf[:n] = hidden_rows
        self.rows_buf[n:].zero_()
        self.n = n
        return self.rows_buf

    def logits(self, rows, weight, bias, inv_t):
        if not rows.is_cuda and self.w32 is None:  # off CUDA: one fp32 copy of the weight per pass
            self.w32 = weight.float()
        with exact_cuda_matmuls(rows.device):
            z = mm32(rows, (weight if rows.is_cuda else self.w32).T, out=self.buf)
        if bias is not None:
            z += bias.float()
        z *= inv_t
        return z[: self.n]

    def _full_grad(self, grad_z):
        """The chunk's gradient as the fixed [step, V] buffer, its padding rows zero."""
        assert grad_z.data_ptr() == self.buf.data_ptr(), "the row kernel writes the gradient in place"
        self.buf[self.n:].zero_()
        return self.buf

    def grad_hidden(self, grad_z, weight):
        if self.gh32 is None:
            self.gh32 = torch.empty(self.step, weight.shape[1], dtype=torch.float32, device=self.device)
        with exact_cuda_matmuls(weight.device):
            return mixed_addmm32_(self.gh32.zero_(), self._full_grad(grad_z), weight)[: self.n]

    def accumulate_grad_weight(self, gw32, grad_z, rows):
        with exact_cuda_matmuls(rows.device):
            mixed_addmm32_(gw32, self._full_grad(grad_z).T, rows)
