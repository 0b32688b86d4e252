"""The row-chunk driver shared by the ``cuda`` and ``npu`` fused linear log-probs backends.

Both walk the N rows of ``hidden`` in chunks whose fp32 logits tile ``[n, V]`` fits
``PORTARL_CHUNK_ELEMENTS`` (:func:`portarl.backends.rows.chunk_rows`), and differ only in
how a tile is computed and contracted (a :class:`ChunkMath`) and in the per-chunk row op
(a callable given to the driver):

- :func:`forward_chunks`: ``row_forward(r0, r1, z)`` on each chunk's tile
  ``z = (hidden[r0:r1] @ weight.T + bias) / T`` (fp32), which stores the rows' results;
- :func:`backward_chunks`: recompute each tile, ``grad_z = row_backward(r0, r1, z)`` (its
  d loss / d logits, in place or new), then grad_hidden[r0:r1] = grad_z @ weight (fp32,
  cast per chunk), grad_weight += grad_z.T @ hidden[r0:r1] and grad_bias += sum(grad_z)
  in fp32 accumulators over the chunks, each cast once at the end.

Nothing N x V exists in either direction. The driver never binds a tile to a name of its
own, so a row op that drops its tile (``del z``) frees it before the contractions.

The ``reference`` backend does not use this driver: it walks vocabulary blocks in its outer
loop (so each weight block is upcast once per pass) with online row statistics, a
different loop nest.
"""

from __future__ import annotations

from typing import Callable

import torch

from portarl.backends.rows import chunk_rows


class ChunkMath:
    """How one backend computes a chunk's logits tile and contracts its gradient."""

    #: Most rows a chunk may hold (an operator's limit), or None for the chunk budget alone.
    max_rows: int | None = None
    #: Whether every chunk has the same number of rows whatever N (a GEMM library picks its
    #: algorithm from the shape: the ``cublas`` head pads the last chunk to it).
    fixed_rows: bool = False

    def start(self, step: int, vocab: int, device: torch.device) -> None:
        """Called once per pass, before the first chunk of at most ``step`` rows."""

    def rows(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """The chunk's hidden states as the tile and weight-gradient products read them."""
        return hidden_rows

    def logits(self, rows, weight, bias, inv_t) -> torch.Tensor:
        """fp32 ``[n, V]`` tile ``(rows @ weight.T + bias) * inv_t``."""
        raise NotImplementedError

    def grad_hidden(self, grad_z, weight) -> torch.Tensor:
        """fp32 ``[n, H]`` ``grad_z @ weight``."""
        raise NotImplementedError

    def accumulate_grad_weight(self, gw32, grad_z, rows) -> None:
        """``gw32 += grad_z.T @ rows`` (fp32 [V, H])."""
        raise NotImplementedError


def _step(math: ChunkMath, n_rows: int, vocab: int) -> int:
    if math.fixed_rows:
        return chunk_rows(vocab, max_rows=math.max_rows)
    cap = n_rows if math.max_rows is None else min(n_rows, math.max_rows)
    return chunk_rows(vocab, max_rows=cap)


def forward_chunks(math: ChunkMath, hidden, weight, bias, inv_t,
                   row_forward: Callable[[int, int, torch.Tensor], None]) -> None:
    """Call ``row_forward(r0, r1, z)`` with the fp32 logits tile of every row chunk."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    step = _step(math, n_rows, vocab)
    math.start(step, vocab, hidden.device)
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        row_forward(r0, r1, math.logits(math.rows(hidden[r0:r1]), weight, bias, inv_t))


def backward_chunks(math: ChunkMath, hidden, weight, bias, inv_t,
                    row_backward: Callable[[int, int, torch.Tensor], torch.Tensor], needs):
    """``(grad_hidden, grad_weight, grad_bias)`` (None where ``needs`` is False), in the inputs' dtypes.

    ``row_backward(r0, r1, z)`` returns the fp32 ``[r1 - r0, V]`` gradient of the loss with
    respect to the chunk's logits (``z`` already divided by T; the gradient includes 1/T).
    """
    want_h, want_w, want_b = needs
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    step = _step(math, n_rows, vocab)
    math.start(step, vocab, hidden.device)
    grad_h = torch.empty_like(hidden) if want_h else None
    gw32 = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
    gb32 = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if want_b else None
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        rows = math.rows(hidden[r0:r1])
        grad_z = row_backward(r0, r1, math.logits(rows, weight, bias, inv_t))
        if want_h:
            grad_h[r0:r1] = math.grad_hidden(grad_z, weight)
        if want_w:
            math.accumulate_grad_weight(gw32, grad_z, rows)
        if want_b:
            gb32 += grad_z.sum(dim=0)
        del grad_z, rows
    grad_w = gw32.to(weight.dtype) if want_w else None
    grad_b = gb32.to(bias.dtype) if want_b else None
    return grad_h, grad_w, grad_b
