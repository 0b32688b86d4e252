"""PPO with a value model: generalized advantage estimation (GAE) and the clipped value loss.

Written from the formulas (Schulman et al. 2016, "High-dimensional continuous control using
generalized advantage estimation"), and matching verl's ``compute_gae_advantage_return`` /
``compute_value_loss`` (``verl/trainer/ppo/core_algos.py``) on the same data
(``tests/core/test_gae.py`` holds both to a float64 reference):

- per token t of a response, backwards: ``delta_t = r_t + gamma * V_{t+1} - V_t`` and
  ``A_t = delta_t + gamma * lam * A_{t+1}``, the value after the last token 0;
- a masked token (padding, or in a multi-turn episode a tool or environment token, which
  the policy did not produce) takes no part: ``V_{t+1}`` and ``A_{t+1}`` carry over across
  it unchanged, so the recursion runs over the model's own tokens only;
- ``returns = A + V`` (before whitening), the value targets;
- ``A`` whitened over the batch's masked tokens (mean 0, std 1): ``whiten=True`` (verl's
  default); masked tokens are 0.

The rewards are per token: an outcome reward sits on each response's last model token
(:func:`outcome_token_rewards`), a KL-in-reward penalty on every token.

The value loss, with ``cliprange`` c and the values ``V_old`` the rollout scored with:
``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` per token, aggregated
like the policy loss (:func:`portarl.core.aggregation.aggregate_loss`); ``clipfrac`` the
share of tokens where the clipped term is the larger.

Precision: the recursion runs in float64 on the host (per token, few thousand per row: the
cost is the sequential loop, not the arithmetic); results in float32 on the inputs' device.
"""

from __future__ import annotations

import torch

from portarl.core._checks import check_mask, check_tokens
from portarl.core.aggregation import aggregate_loss


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] float32: each row's reward on its last masked-in token, 0 elsewhere (a row
    with no token gets none)."""
    mask = mask.bool()
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards must be [B] = [{mask.shape[0]}], got {tuple(rewards.shape)}")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=1)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = rewards.to(out.device, torch.float32)[rows]
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over the masked-in entries (the unbiased variance,
    verl's ``masked_whiten``); masked-out entries 0."""
    m = mask.to(values.dtype)
    n = m.sum()
    mean = (values * m).sum() / n.clamp(min=1)
    var = (((values - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * m


def compute_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
                lam: float = 1.0, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both [B, T] float32 on ``values``' device (see the module doc).

    Args:
        token_rewards: [B, T] per-token rewards (masked-out entries ignored).
        values: [B, T] the value model's V_t for each response token (masked-out ignored).
        mask: [B, T] bool, the tokens the policy produced.
        gamma: discount in [0, 1]; lam: GAE lambda in [0, 1].
        whiten: whiten the advantages over the masked-in tokens.
    """
    check_tokens("values", values)
    check_tokens("token_rewards", token_rewards, values)
    mask = check_mask(mask, values)
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= float(x) <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {x!r}")
    r = token_rewards.detach().to("cpu", torch.float64)
    v = values.detach().to("cpu", torch.float64)
    m = mask.to("cpu", torch.float64)
    if not (torch.isfinite(r) | (m == 0)).all() or not (torch.isfinite(v) | (m == 0)).all():
        raise ValueError("token_rewards and values must be finite on the masked-in tokens")
    r, v = r * m, v * m
    b, t = v.shape
    next_value = torch.zeros(b, dtype=torch.float64)
    next_adv = torch.zeros(b, dtype=torch.float64)
    adv = torch.zeros(b, t, dtype=torch.float64)
    for i in range(t - 1, -1, -1):
        delta = r[:, i] + gamma * next_value - v[:, i]
        here = delta + gamma * lam * next_adv
        keep = m[:, i]
        next_value = v[:, i] * keep + (1 - keep) * next_value
        next_adv = here * keep + (1 - keep) * next_adv
        adv[:, i] = next_adv
    returns = (adv + v) * m
    adv = masked_whiten(adv, m) if whiten else adv * m
    device = values.device
    return adv.to(device, torch.float32), returns.to(device, torch.float32)


def value_loss(vpreds: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor, *,
               cliprange: float | None = 0.5, mode: str = "token-mean", num_global_tokens: int | None = None,
               num_global_seqs: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped value loss (see the module doc) and its metrics (``value/clipfrac``,
    ``value/vpred_mean``): scalar fp32 with the gradient of ``vpreds``. ``cliprange``
    None: unclipped, 0.5 * (V - R)^2."""
    check_tokens("vpreds", vpreds)
    check_tokens("returns", returns, vpreds)
    check_tokens("old_values", old_values, vpreds)
    mask = check_mask(mask, vpreds)
    v = vpreds.float()
    unclipped = (v - returns.float()) ** 2
    if cliprange is None:
        per_token, clipped_larger = unclipped, torch.zeros_like(mask)
    else:
        if not cliprange > 0:
            raise ValueError(f"critic.cliprange_value must be > 0 (or null: no clip), got {cliprange!r}")
        clipped = old_values.float() + (v - old_values.float()).clamp(-cliprange, cliprange)
        clipped_loss = (clipped - returns.float()) ** 2
        per_token, clipped_larger = torch.maximum(unclipped, clipped_loss), clipped_loss > unclipped
    loss = 0.5 * aggregate_loss(per_token, mask, mode=mode, num_global_tokens=num_global_tokens,
                                num_global_seqs=num_global_seqs)
    n = mask.sum().clamp(min=1)
    metrics = {"value/clipfrac": ((clipped_larger & mask).sum() / n).detach(),
               "value/vpred_mean": ((v.detach() * mask).sum() / n)}
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked-in tokens (1: perfect; 0: no better than the
    mean; NaN when the returns do not vary)."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    if r.numel() < 2:
        return float("nan")
    var = r.var()
    return float("nan") if var == 0 else float(1 - (r - v).var() / var)


__all__ = ["compute_gae", "explained_variance", "masked_whiten", "outcome_token_rewards", "value_loss"]
