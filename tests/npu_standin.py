"""A CPU stand-in for ``torch_npu``: the documented semantics of the one operator portarl
calls, so the npu backend's logic (chunking, fp32 feeding, masking, autograd) runs in CI.

NOT hardware parity: numbers from this module say nothing about Ascend kernels. What it
implements, from the Ascend Extension for PyTorch reference for
``torch_npu.npu_cross_entropy_loss``:

- input [N, C] float16 / bfloat16 / float32 with 0 < N <= 200000; target int64 [N];
- reduction "none" | "mean" | "sum"; a negative ignore_index ignores nothing (every
  target must then be in [0, C));
- returns (loss, log_prob, zloss, lse_for_zloss): loss and log_prob in the input's dtype,
  and only loss carries a gradient.

Every call is recorded in :data:`calls` so tests can check what the backend fed it.
"""

from __future__ import annotations

import dataclasses

import torch

__version__ = "standin"

MAX_ROWS = 200_000


@dataclasses.dataclass
class Call:
    rows: int
    cols: int
    dtype: torch.dtype
    reduction: str
    ignore_index: int
    targets_in_range: bool


calls: list[Call] = []


def npu_cross_entropy_loss(
    input,
    target,
    weight=None,
    reduction="mean",
    ignore_index=-100,
    label_smoothing=0.0,
    lse_square_scale_for_zloss=0.0,
    return_zloss=False,
):
    if input.dim() != 2:
        raise RuntimeError(f"npu_cross_entropy_loss: input must be 2-D [N, C], got {tuple(input.shape)}")
    n, c = input.shape
    if not 0 < n <= MAX_ROWS:
        raise RuntimeError(f"npu_cross_entropy_loss: N={n} outside (0, {MAX_ROWS}]")
    if input.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError(f"npu_cross_entropy_loss: unsupported dtype {input.dtype}")
    if target.dtype != torch.int64 or target.shape != (n,):
        raise RuntimeError("npu_cross_entropy_loss: target must be int64 [N]")
    if reduction not in ("none", "mean", "sum"):
        raise RuntimeError(f"npu_cross_entropy_loss: bad reduction {reduction!r}")
    ignored = (target == ignore_index) if ignore_index >= 0 else torch.zeros_like(target, dtype=torch.bool)
    in_range = bool(((target >= 0) & (target < c) | ignored).all())
    calls.append(Call(n, c, input.dtype, reduction, ignore_index, in_range))
    if not in_range:
        raise RuntimeError("npu_cross_entropy_loss: target out of range (device-side assert on hardware)")
    # Computed in fp32 and returned in the input's dtype, as documented.
    log_sm = torch.log_softmax(input.float(), dim=-1)
    safe_target = torch.where(ignored, 0, target)
    per_row = -log_sm.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
    per_row = torch.where(ignored, 0.0, per_row)
    if reduction == "none":
        loss = per_row
    elif reduction == "sum":
        loss = per_row.sum()
    else:
        loss = per_row.sum() / (~ignored).sum().clamp(min=1)
    log_prob = log_sm.detach().to(input.dtype)
    zeros = torch.zeros_like(per_row).detach()
    return loss.to(input.dtype), log_prob, zeros, zeros
