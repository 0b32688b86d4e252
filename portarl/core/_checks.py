"""Input checks shared by portarl.core: errors name the argument and the fix."""

from __future__ import annotations

import math

import torch


def check_tokens(name: str, value: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """A floating [B, T] tensor (the shape of ``like`` when given)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 2:
        raise ValueError(f"{name} must be [batch, response_length], got shape {tuple(value.shape)}")
    if like is not None and value.shape != like.shape:
        raise ValueError(f"{name} shape {tuple(value.shape)} must equal {tuple(like.shape)}")
    if like is not None and value.device != like.device:
        raise ValueError(f"{name} is on {value.device} but the log-probs are on {like.device}; move it with .to()")
    return value


def check_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The response mask as bool [B, T]."""
    check_tokens("mask", mask, like)
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point and bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("mask must hold 0/1 (or bool); got other values: pass a bool or 0/1 response mask")
        mask = mask != 0
    return mask


def per_sequence(name: str, value: torch.Tensor, batch: int) -> torch.Tensor:
    """A [B] tensor viewed as [B, 1], or a [B, T] tensor as is."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() == 1:
        if value.shape[0] != batch:
            raise ValueError(f"{name} has {value.shape[0]} entries but the batch has {batch} sequences")
        return value.unsqueeze(-1)
    if value.dim() == 2 and value.shape[0] == batch:
        return value
    raise ValueError(f"{name} must be [batch] (per sequence) or [batch, response_length], got {tuple(value.shape)}")


def check_positive(name: str, value, *, allow_none: bool = False, minimum: float = 0.0, inclusive: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < minimum or (value == minimum and not inclusive):
        raise ValueError(f"{name} must be {'>=' if inclusive else '>'} {minimum}, got {value}")
    return float(value)


def reject_unknown(kind: str, options: dict) -> None:
    if options:
        raise TypeError(f"{kind} got unknown option(s): {', '.join(sorted(options))}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask``; 0 when the mask is empty (metrics, never NaN)."""
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1)


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``values`` over ``mask``; 0 when the mask is empty. No host sync (no
    ``mask.any()`` branch, no boolean indexing): metrics stay on the device."""
    if values.numel() == 0:
        return values.new_zeros(())
    out = torch.where(mask, values, float("-inf")).amax()
    return torch.where(mask.any(), out, values.new_zeros(()))


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min of ``values`` over ``mask``; 0 when the mask is empty. No host sync."""
    if values.numel() == 0:
        return values.new_zeros(())
    out = torch.where(mask, values, float("inf")).amin()
    return torch.where(mask.any(), out, values.new_zeros(()))
