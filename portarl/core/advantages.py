"""Advantage estimators for outcome rewards, one advantage per sequence, by name.

Rewards come as ``[B]`` with the ``group_size`` samples of each prompt adjacent
(``B = num_prompts * group_size``). Statistics are computed on the CPU in float64 (rewards
are few, so exactness is free, and Ascend NPUs have little float64 support); advantages
are returned as float32 on the rewards' device.

A group whose rewards have zero spread (all equal, or a single sample) carries no learning
signal: its advantages are exactly 0, never NaN, and it is counted in ``frac_zero_std``.
With ``drop_zero_std=True`` (DAPO dynamic sampling) ``keep`` marks such groups' sequences
False so the caller can drop them from the batch.
"""

from __future__ import annotations

import dataclasses

import torch

from portarl.core._checks import check_positive, reject_unknown
from portarl.core.registry import Registry

#: Registered estimators: ``fn(grouped_rewards [G, n] float64, zero_std [G] bool, **options) -> [G, n]``.
ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


@dataclasses.dataclass
class AdvantageResult:
    """``advantages`` float32 [B]; ``keep`` bool [B]; ``metrics`` of 0-dim tensors."""

    advantages: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _zero_spread(grouped: torch.Tensor) -> torch.Tensor:
    return grouped.amax(dim=1) == grouped.amin(dim=1)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(grouped, zero_std, *, scale: str = "group", eps: float = 1e-6, **options):
    """(r - group mean) / (std + eps). ``scale``: "group" (GRPO: the group's std), "batch"
    (the std of all rewards in the batch), "none" (Dr. GRPO: no division). Stds are the
    unbiased (n - 1) estimate, as torch.std."""
    reject_unknown("grpo advantages", options)
    check_positive("eps", eps, inclusive=True)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if grouped.shape[1] > 1 else torch.zeros_like(centered[:, :1])
        return centered / (std + eps)
    if scale == "batch":
        flat = grouped.reshape(-1)
        std = flat.std() if flat.numel() > 1 else flat.new_zeros(())
        return centered / (std + eps)
    if scale == "none":
        return centered
    raise ValueError(f"scale={scale!r} must be 'group', 'batch' or 'none' (Dr. GRPO)")


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(grouped, zero_std, **options):
    """r_i minus the mean of the *other* samples of its group: n / (n - 1) * (r_i - mean)."""
    reject_unknown("rloo advantages", options)
    n = grouped.shape[1]
    if n < 2:
        raise ValueError("rloo needs group_size >= 2 (the baseline is the other samples' mean)")
    return (grouped - grouped.mean(dim=1, keepdim=True)) * (n / (n - 1))


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp(grouped, zero_std, *, eps: float = 1e-6, **options):
    """REINFORCE++ with a group baseline: subtract the group mean, then whiten over the batch
    (over the sequences of groups with spread, so zero-spread groups stay exactly 0)."""
    reject_unknown("reinforce_pp advantages", options)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    live = centered[~zero_std]
    if live.numel() < 2:
        return torch.zeros_like(centered)
    return (centered - live.mean()) / (live.std() + eps)


def compute_advantages(
    rewards: torch.Tensor,
    group_size: int,
    estimator: str = "grpo",
    *,
    drop_zero_std: bool = False,
    **options,
) -> AdvantageResult:
    """One advantage per sequence from per-sequence rewards.

    Args:
        rewards: [B] finite numbers, groups of ``group_size`` adjacent.
        group_size: samples per prompt; must divide B.
        estimator: a name in :data:`ADVANTAGE_ESTIMATORS` ("grpo", "rloo", "reinforce_pp").
        drop_zero_std: mark zero-spread groups ``keep=False`` (DAPO dynamic sampling).
        options: passed to the estimator (grpo: ``scale``, ``eps``; reinforce_pp: ``eps``).

    Returns:
        :class:`AdvantageResult`; metrics ``frac_zero_std`` (fraction of groups),
        ``reward_mean``, ``reward_std``, ``adv_mean``, ``adv_abs_max``, ``frac_kept``.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [batch], got {getattr(rewards, 'shape', type(rewards).__name__)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}")
    if not bool(torch.isfinite(rewards).all()):
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten()[:5].tolist()
        raise ValueError(f"rewards must be finite; non-finite at indices {bad}: fix the reward function")
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    grouped = rewards.detach().to("cpu", torch.float64).reshape(-1, group_size)
    zero_std = _zero_spread(grouped)
    adv = fn(grouped, zero_std, **options)
    adv = torch.where(zero_std.unsqueeze(1), torch.zeros_like(adv), adv)
    keep = (~zero_std if drop_zero_std else torch.ones_like(zero_std)).repeat_interleave(group_size)
    advantages = adv.reshape(-1).to(torch.float32)
    metrics = {
        "frac_zero_std": zero_std.double().mean() if zero_std.numel() else grouped.new_zeros(()),
        "reward_mean": grouped.mean() if grouped.numel() else grouped.new_zeros(()),
        "reward_std": grouped.std() if grouped.numel() > 1 else grouped.new_zeros(()),
        "adv_mean": advantages.double().mean() if advantages.numel() else grouped.new_zeros(()),
        "adv_abs_max": advantages.abs().max().double() if advantages.numel() else grouped.new_zeros(()),
        "frac_kept": keep.double().mean() if keep.numel() else grouped.new_zeros(()),
    }
    return AdvantageResult(
        advantages.to(rewards.device), keep.to(rewards.device), {k: v.float() for k, v in metrics.items()}
    )
