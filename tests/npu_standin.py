"""A CPU stand-in for ``torch_npu``: the documented semantics of the one operator portarl
calls, so the npu backend's logic (chunking, fp32 feeding, masking, autograd) runs in CI.

NOT hardware parity: numbers from this module say nothing about Ascend kernels. What it
implements, from the Ascend Extension for PyTorch reference for
``torch_npu.npu_cross_entropy_loss``:

- input [N, C] float16 / bfloat16 / float32 with 0 < N <= 200000 and C > 0; target int64
  [N] on the input's device; weight, when given, float32 [C] in (0, 1];
- reduction "none" | "mean" | "sum"; ignore_index < C, and a negative one ignores nothing
  (every target must then be in [0, C)); label_smoothing in [0, 1);
- the z-loss arguments (lse_square_scale_for_zloss, return_zloss) are "not supported yet":
  anything but their defaults is refused;
- with input.requires_grad: in "sum" / "none" mode label_smoothing must keep its default,
  in "mean" mode every argument with a default must keep it;
- returns (loss, log_prob, zloss, lse_for_zloss): loss and log_prob in the input's dtype,
  and only loss carries a gradient.

And the hazard portarl must keep away from it (issue 32): the loss includes the label-
smoothing term ``label_smoothing * -sum_j log_prob[j] / C``, summed over the whole row even
at ``label_smoothing=0``, as some implementations compute it. A row with a -inf entry (a
masked vocabulary), or whose log-probs sum past the dtype's range, then gives 0 * inf =
NaN. Whether Ascend's kernel does this is not known; the stand-in assumes the worst, so a
backend that feeds it -inf logits gets NaN here, not only on hardware.

Every call is recorded in :data:`calls` so tests can check what the backend fed it.
"""

from __future__ import annotations

import dataclasses
import types

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
    has_neg_inf: bool


calls: list[Call] = []

#: torch_npu's option store (``torch_npu._C._npu_getOption`` / ``_npu_setOption``), which
#: holds the precision switches (``torch.npu.config.allow_internal_format``,
#: ``torch.npu.matmul.allow_hf32``, ...): values "enable" / "disable", absent until set.
options: dict[str, str] = {}


def _npu_getOption(name: str) -> bytes | None:
    value = options.get(name)
    return None if value is None else value.encode()


def _npu_setOption(values: dict) -> None:
    for name, value in values.items():
        if value not in ("enable", "disable"):
            raise RuntimeError(f"_npu_setOption: {name}={value!r} is not enable / disable")
        options[name] = value


_C = types.SimpleNamespace(_npu_getOption=_npu_getOption, _npu_setOption=_npu_setOption)


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
    _refuse_what_the_operator_refuses(input, target, weight, reduction, ignore_index, label_smoothing,
                                      lse_square_scale_for_zloss, return_zloss)
    n, c = input.shape
    ignored = (target == ignore_index) if ignore_index >= 0 else torch.zeros_like(target, dtype=torch.bool)
    in_range = bool(((target >= 0) & (target < c) | ignored).all())
    calls.append(Call(n, c, input.dtype, reduction, ignore_index, in_range, bool(torch.isneginf(input).any())))
    if not in_range:
        raise RuntimeError("npu_cross_entropy_loss: target out of range (device-side assert on hardware)")
    # Computed in fp32 and returned in the input's dtype, as documented.
    log_sm = torch.log_softmax(input.float(), dim=-1)
    safe_target = torch.where(ignored, 0, target)
    nll = -log_sm.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
    if weight is not None:
        nll = nll * weight.gather(0, safe_target)
    # The label-smoothing term over the whole row, also at label_smoothing = 0 (see above):
    # NaN for a row with a -inf entry, or whose log-prob sum overflows.
    smooth = -log_sm.sum(dim=-1) / c
    per_row = (1.0 - label_smoothing) * nll + label_smoothing * smooth
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


def _refuse_what_the_operator_refuses(input, target, weight, reduction, ignore_index, label_smoothing,
                                      lse_square_scale_for_zloss, return_zloss) -> None:
    """RuntimeError, as the operator raises, for every documented constraint."""
    if input.dim() != 2:
        raise RuntimeError(f"npu_cross_entropy_loss: input must be 2-D [N, C], got {tuple(input.shape)}")
    n, c = input.shape
    if not 0 < n <= MAX_ROWS:
        raise RuntimeError(f"npu_cross_entropy_loss: N={n} outside (0, {MAX_ROWS}]")
    if c <= 0:
        raise RuntimeError(f"npu_cross_entropy_loss: C={c} must be > 0")
    if input.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError(f"npu_cross_entropy_loss: unsupported dtype {input.dtype}")
    if target.dtype != torch.int64 or target.shape != (n,):
        raise RuntimeError("npu_cross_entropy_loss: target must be int64 [N]")
    if target.device != input.device:
        raise RuntimeError(f"npu_cross_entropy_loss: target on {target.device}, input on {input.device}")
    if weight is not None and (weight.dtype != torch.float32 or weight.shape != (c,)
                               or not bool(((weight > 0) & (weight <= 1)).all())):
        raise RuntimeError("npu_cross_entropy_loss: weight must be float32 [C] with values in (0, 1]")
    if reduction not in ("none", "mean", "sum"):
        raise RuntimeError(f"npu_cross_entropy_loss: bad reduction {reduction!r}")
    if ignore_index >= c:
        raise RuntimeError(f"npu_cross_entropy_loss: ignore_index={ignore_index} must be < C={c}")
    if not 0.0 <= label_smoothing < 1.0:
        raise RuntimeError(f"npu_cross_entropy_loss: label_smoothing={label_smoothing} outside [0, 1)")
    if lse_square_scale_for_zloss != 0.0 or return_zloss:
        raise RuntimeError("npu_cross_entropy_loss: z-loss (lse_square_scale_for_zloss, return_zloss) is not supported yet")
    if input.requires_grad:
        if reduction == "mean" and (weight is not None or ignore_index != -100 or label_smoothing != 0.0):
            raise RuntimeError("npu_cross_entropy_loss: with requires_grad, mean mode takes every argument at its default")
        if reduction != "mean" and label_smoothing != 0.0:
            raise RuntimeError("npu_cross_entropy_loss: with requires_grad, label_smoothing must be 0.0 in sum / none mode")
