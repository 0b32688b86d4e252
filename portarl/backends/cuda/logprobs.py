"""Host side of the Triton log-probs / entropy kernels: launch, autograd, tile choice.

Launch configurations come from :func:`portarl.kernels.logprobs.forward_config` and
:func:`~portarl.kernels.logprobs.backward_config` (functions of V only, so results are
batch invariant, and the same functions enumerate the ahead-of-time compiled variants).

Entry points for other ops (for example a chunked fused linear log-prob op):
- :func:`forward_rows`: logp, lse (and H) of any strided ``[..., V]`` logits, no autograd;
- :func:`backward_rows`: the logits gradient from those, into a new buffer or, with
  ``inplace=True``, over the logits themselves (the caller must own them: flash-attention's
  ``inplace_backward``, Liger's reuse of the logits chunk for its gradient);
- :func:`triton_logprobs` with ``inplace_backward=True``: the autograd op with that option.
"""

from __future__ import annotations

import torch
import triton

from portarl.backends.cuda import grid
from portarl.backends.rows import row_offsets
from portarl.kernels import round_bf16_in_interpreter
from portarl.kernels.logprobs import (
    backward_config,
    forward_config,
    logprobs_forward_kernel,
    logprobs_grad_kernel,
)


def block_for(n_cols: int) -> int:
    """Forward tile (columns) for a vocabulary of ``n_cols``: ``forward_config(n_cols)["BLOCK_V"]``."""
    return forward_config(n_cols)["BLOCK_V"]


def _num_warps(block: int) -> int:  # kept for callers of the old helper
    return 8 if block >= 2048 else 4


def _non_overlapping(t: torch.Tensor) -> bool:
    """No two elements of ``t`` share memory (so it can be overwritten element by element)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            return False
        span = stride * size
    return True


def forward_rows(logits, labels, inv_temperature: float, ignore_index: int, with_entropy: bool, offsets=None):
    """fp32 ``(logp, lse, entropy | None)`` of shape [N] for ``logits`` [..., V] and flat int64 ``labels`` [N]."""
    n_cols = logits.shape[-1]
    n_rows = labels.numel()
    offsets = row_offsets(logits) if offsets is None else offsets
    logp = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    config = forward_config(n_cols)
    if n_rows:
        logprobs_forward_kernel[grid.programs(n_rows)](
            logits, offsets, logits.stride(-1), labels, logp, entropy if with_entropy else lse, lse,
            n_rows, n_cols, inv_temperature, ignore_index, WITH_ENTROPY=with_entropy, **config,
        )
    return logp, lse, entropy


def backward_rows(logits, labels, lse, entropy, g_logp, g_entropy, inv_temperature: float, ignore_index: int,
                  *, inplace: bool = False, offsets=None) -> torch.Tensor:
    """d(loss)/d(logits) in the logits' dtype; ``entropy`` / ``g_entropy`` None without the entropy term.

    ``inplace=True`` overwrites ``logits`` with the gradient and returns it; ``logits`` must
    not overlap itself (no expanded / broadcast views). Otherwise a new contiguous buffer.
    One item per (row, column block of ``backward_config(V)["BLOCK_V"]``), on a persistent grid.
    """
    n_cols = logits.shape[-1]
    n_rows = labels.numel()
    offsets = row_offsets(logits) if offsets is None else offsets
    g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
    use_entropy = entropy is not None and g_entropy is not None
    if inplace:
        if not _non_overlapping(logits):
            raise ValueError("inplace backward needs logits whose elements do not overlap (no expanded views)")
        grad = logits
    else:
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    config = backward_config(n_cols)
    if n_rows and n_cols:
        logprobs_grad_kernel[grid.programs(n_rows * triton.cdiv(n_cols, config["BLOCK_V"]))](
            logits, offsets, logits.stride(-1), labels, lse,
            entropy if use_entropy else lse,
            g_logp,
            g_entropy.float().contiguous() if use_entropy else g_logp,
            lse if inplace else grad,  # in place: a dummy, the kernel writes through logits_ptr
            n_rows, n_cols, inv_temperature, ignore_index,
            WITH_ENTROPY=use_entropy, IN_PLACE=inplace, ROUND_BF16=round_bf16_in_interpreter(grad.dtype), **config,
        )
    return grad


class TritonLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, inv_temperature, ignore_index, with_entropy, inplace_backward=False):
        offsets = row_offsets(logits)
        logp, lse, entropy = forward_rows(logits, labels, inv_temperature, ignore_index, with_entropy, offsets)
        ctx.save_for_backward(logits, labels, offsets, lse, entropy)
        ctx.inv_temperature = inv_temperature
        ctx.ignore_index = ignore_index
        ctx.with_entropy = with_entropy
        ctx.inplace_backward = inplace_backward
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, labels, offsets, lse, entropy = ctx.saved_tensors
        use_entropy = ctx.with_entropy and g_entropy is not None
        grad = backward_rows(
            logits, labels, lse, entropy if use_entropy else None, g_logp, g_entropy if use_entropy else None,
            ctx.inv_temperature, ctx.ignore_index, inplace=ctx.inplace_backward, offsets=offsets,
        )
        return grad, None, None, None, None, None


def triton_logprobs(logits, labels, *, temperature, ignore_index, return_entropy, inplace_backward=False):
    """The autograd op. ``inplace_backward=True``: the backward overwrites ``logits`` with its
    gradient (no second N x V buffer); only for logits the caller owns and never reads again."""
    return TritonLogprobs.apply(
        logits, labels.contiguous(), 1.0 / temperature, ignore_index, return_entropy, inplace_backward
    )
