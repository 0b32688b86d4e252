"""Length shaping of a rollout batch: DAPO's soft overlong punishment (a reward term) and
TRL's truncated-completion masking (a loss mask). Both off by default (``shaping``).

Soft overlong punishment (DAPO, Yu et al. 2025, arXiv 2503.14476, eq. 13; verl's
``overlong_buffer``): with L_max = ``rollout.max_new_tokens`` and L_cache =
``shaping.overlong_buffer``, a completion of |y| tokens gets

    penalty(|y|) = factor * min(0, ((L_max - L_cache) - |y|) / L_cache)

added to its reward: 0 up to L_max - L_cache tokens, then linear down to -factor at L_max
(completions never exceed L_max here, so DAPO's "-1 beyond L_max" case is the endpoint).
|y| counts every generated token, the end token included (verl's valid response length).

Truncated-completion masking (TRL's ``mask_truncated_completions``): a completion that
stopped at the token budget without an end token (``RolloutBatch.finished`` false) is
taken out of the loss mask; its reward still takes part in its group's advantages, as in TRL.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: list[int], max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """[N] fp32 penalties (<= 0) for completions of ``lengths`` tokens; zeros when ``buffer`` is 0."""
    n = torch.tensor(lengths, dtype=torch.float64)
    if buffer <= 0:
        return torch.zeros(len(lengths), dtype=torch.float32)
    expected = max_new_tokens - buffer
    return (factor * torch.clamp((expected - n) / buffer, max=0.0)).float()


def shape_rewards(config, rewards: torch.Tensor, completion_ids: list[list[int]], metrics: dict) -> torch.Tensor:
    """``rewards`` plus the overlong penalty when ``shaping.overlong_buffer`` > 0; adds
    ``shaping/overlong_penalty_mean`` and ``shaping/overlong_frac`` (share penalised)."""
    s = config.shaping
    if s.overlong_buffer == 0:
        return rewards
    penalty = overlong_penalty([len(c) for c in completion_ids], config.rollout.max_new_tokens, s.overlong_buffer,
                               s.overlong_penalty_factor)
    metrics["shaping/overlong_penalty_mean"] = float(penalty.mean()) if penalty.numel() else 0.0
    metrics["shaping/overlong_frac"] = float((penalty < 0).float().mean()) if penalty.numel() else 0.0
    return rewards + penalty.to(rewards.dtype)


def truncated_keep(config, finished: list[bool], device, metrics: dict) -> torch.Tensor | None:
    """[N] bool: rows that stay in the loss (not truncated), or None when masking is off.
    Adds ``shaping/truncated_masked_frac``."""
    if not config.shaping.mask_truncated_completions:
        return None
    keep = torch.tensor([bool(f) for f in finished], dtype=torch.bool)
    metrics["shaping/truncated_masked_frac"] = float((~keep).float().mean()) if keep.numel() else 0.0
    return keep.to(device)
