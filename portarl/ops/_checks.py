"""Argument checks shared by the public ops: every error names the argument and the fix."""

from __future__ import annotations

import math
import os

import torch

#: Floating dtypes the ops accept. Compute is fp32 for all of them.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_BACKEND_ATTR = "_portarl_backend"

#: Limits of the ops' arguments, in one place.
#: Every backend scales logits by ``1 / temperature`` in fp32 before the softmax. With
#: ``temperature >= TEMPERATURE_MIN`` that scale is at most 1e6, so any finite logit of
#: magnitude below ``FP32_MAX * TEMPERATURE_MIN`` (about 3.4e32; every finite fp16 logit, and
#: any logit a real model produces) stays finite. Smaller temperatures (1e-45 makes the scale
#: ``inf``) overflow finite logits to inf and every row's log-prob to NaN. For greedy-like
#: scoring use a small temperature in range, or the argmax. There is no upper limit: a huge
#: temperature only flattens the distribution towards uniform.
FP32_MAX = float(torch.finfo(torch.float32).max)
TEMPERATURE_MIN = 1e-6


def check_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_float_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has dtype {tensor.dtype}, which portarl ops do not take; pass float32, "
            f"bfloat16 or float16 (computation is fp32 either way; float64 references live in "
            f"portarl.parity.float64)"
        )


def check_same_device(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        where = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"all inputs must be on one device: {where}; move them with .to(device)")


def check_positive(name: str, value, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, torch.Tensor) or not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        extra = " or None to disable it" if allow_none else ""
        raise ValueError(f"{name} must be a finite number > 0{extra}, got {value}")
    return float(value)


def check_temperature(value) -> float:
    """``temperature`` as a float in ``[TEMPERATURE_MIN, inf)``; the error says the valid range."""
    value = check_positive("temperature", value)
    if value < TEMPERATURE_MIN:
        raise ValueError(
            f"temperature={value!r} is too small: logits are scaled by 1/temperature in fp32, which overflows "
            f"finite logits (1/{value!r} = {1.0 / value if value > 1 / FP32_MAX else float('inf'):.3g}); the valid "
            f"range is [{TEMPERATURE_MIN:g}, inf), which keeps every finite logit below "
            f"{FP32_MAX * TEMPERATURE_MIN:.3g} in magnitude finite"
        )
    return value


#: Set to 1 for eager value checks on accelerators too (labels in range, loss normalisers
#: not below the local counts): a blocking host sync per call, but the exact error (how
#: many values are bad, the first one) at the call that got them.
DEBUG_CHECKS_ENV = "PORTARL_DEBUG_CHECKS"


def eager_checks(device: torch.device) -> bool:
    """Whether checks of tensor *values* read them on the host now. CPU: always (there is no
    device queue to wait for). Accelerators: only with ``PORTARL_DEBUG_CHECKS=1``; otherwise
    they are device-side asserts (``torch._assert_async``) that fail at the next sync."""
    return device.type == "cpu" or os.environ.get(DEBUG_CHECKS_ENV, "0") == "1"


def check_labels(labels: torch.Tensor, n_cols: int, ignore_index) -> torch.Tensor:
    """Flat int64 labels, each in ``[0, n_cols)`` or equal to ``ignore_index`` (a label out
    of range would otherwise read outside a row).

    On CPU, and with ``PORTARL_DEBUG_CHECKS=1``, the check is eager and the error counts
    the bad labels and names the first. On an accelerator it is a device-side assert
    (``torch._assert_async``): no blocking host sync per call; a bad label fails the next
    synchronising call with a device assert naming this check, and
    ``PORTARL_DEBUG_CHECKS=1`` gives the eager error at the call itself."""
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    flat = labels.reshape(-1).to(torch.int64)
    bad = ((flat < 0) | (flat >= n_cols)) & (flat != ignore_index)
    if not eager_checks(flat.device):
        torch._assert_async(~bad.any(), f"labels: value(s) outside [0, {n_cols}) that are not ignore_index="
                            f"{ignore_index}; set {DEBUG_CHECKS_ENV}=1 for the count and the first bad label")
        return flat
    if bool(bad.any()):
        first = int(flat[bad][0])
        raise ValueError(
            f"labels: {int(bad.sum())} value(s) outside [0, {n_cols}) that are not ignore_index="
            f"{ignore_index} (first: {first}); fix the labels or pass the ignore_index you pad with"
        )
    return flat


def shaped_result(logp: torch.Tensor, entropy: torch.Tensor | None, shape, backend_name: str,
                  return_entropy: bool):
    """An op's flat per-row results in ``shape``, tagged with the backend that computed them:
    ``logp``, or ``(logp, entropy)`` when ``return_entropy``."""
    logp = logp.view(shape)
    tag(logp, backend_name)
    if not return_entropy:
        return logp
    entropy = entropy.view(shape)
    tag(entropy, backend_name)
    return logp, entropy


def tag(tensor: torch.Tensor | None, backend_name: str) -> None:
    """Mark an op result with the backend that computed it (read by :func:`computed_by`)."""
    if tensor is not None:
        setattr(tensor, _BACKEND_ATTR, backend_name)


def computed_by(tensor: torch.Tensor) -> str | None:
    """Name of the backend that computed this op result, or None if it is not an op result."""
    return getattr(tensor, _BACKEND_ATTR, None)
