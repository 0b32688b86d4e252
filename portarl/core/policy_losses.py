"""Policy-gradient losses per token, by name: ``ppo_clip``, ``gspo``, ``reinforce``,
``cispo``, ``sapo``.

Every loss takes ``logp`` (trainer, with grad), ``old_logp`` (behaviour policy, no grad),
``advantages`` ([B] per sequence or [B, T] per token) and a bool ``mask`` [B, T], and
returns ``(per_token_loss [B, T] float32, metrics)``. Masked positions are 0 with zero
gradient even if they hold NaN or inf: inputs are sanitised with ``where`` before any
arithmetic. Log-ratios are clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` (20) before
exp, so a ratio is at most e^20 and never inf. Aggregation over tokens is
:func:`portarl.core.aggregation.aggregate_loss`, the same for every term.

Metrics (0-dim tensors, over valid tokens): ``clip_frac_low`` / ``clip_frac_high`` (where
the lower / upper clip binds), ``dual_clip_frac``, ``approx_kl`` (k3 estimate of
KL(old || new): mean of ratio - 1 - log ratio, >= 0), ``ratio_min`` / ``ratio_mean`` /
``ratio_max``, ``log_ratio_clamped_frac``.
"""

from __future__ import annotations

import torch

from portarl.core._checks import check_positive, masked_max, masked_mean, masked_min, reject_unknown
from portarl.core.registry import Registry

#: ``fn(logp, old_logp, adv [B,T] or [B,1], mask, **options) -> (loss [B,T], metrics)``.
POLICY_LOSSES: Registry = Registry("policy loss")

LOG_RATIO_CLAMP = 20.0


def _log_ratio(logp, old_logp, mask, clamp):
    raw = torch.where(mask, logp.float() - old_logp.float(), torch.zeros_like(logp, dtype=torch.float32))
    clamped = torch.clamp(raw, -clamp, clamp)
    return raw, clamped


def _ratio_metrics(raw, ratio, mask, clamp):
    with torch.no_grad():
        log_ratio = torch.clamp(raw, -clamp, clamp)
        return {
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
            "ratio_min": masked_min(ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": masked_max(ratio, mask),
            "log_ratio_clamped_frac": masked_mean((raw.abs() > clamp).float(), mask),
        }


def _clipped_surrogate(ratio, adv, mask, eps_low, eps_high, dual_clip):
    """PPO's pessimistic surrogate, negated to a loss; dual clip caps it for A < 0."""
    adv = adv.float()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "clip_frac_low": masked_mean(((ratio < 1.0 - eps_low) & (adv < 0)).float(), mask),
        "clip_frac_high": masked_mean(((ratio > 1.0 + eps_high) & (adv > 0)).float(), mask),
    }
    if dual_clip is not None:
        capped = torch.minimum(loss, -adv * dual_clip)
        metrics["dual_clip_frac"] = masked_mean(((adv < 0) & (loss > -adv * dual_clip)).float(), mask)
        loss = torch.where(adv < 0, capped, loss)
    else:
        metrics["dual_clip_frac"] = masked_mean(torch.zeros_like(ratio), mask)
    return torch.where(mask, loss, torch.zeros_like(loss)), metrics


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logp, old_logp, adv, mask, *, eps_low: float = 0.2, eps_high: float = 0.28,
    dual_clip: float | None = 3.0, log_ratio_clamp: float = LOG_RATIO_CLAMP, **options,
):
    """Token-level PPO clip with clip-higher (eps_low 0.2 / eps_high 0.28, DAPO) and dual
    clip c = 3 (for A < 0 the loss is at most -c * A: a huge ratio on a bad token cannot
    dominate the batch). ``dual_clip=None`` disables it."""
    reject_unknown("ppo_clip", options)
    eps_low = check_positive("eps_low", eps_low)
    eps_high = check_positive("eps_high", eps_high)
    if eps_low >= 1.0:
        raise ValueError(f"eps_low must be < 1 (the ratio's lower clip is 1 - eps_low), got {eps_low}")
    dual_clip = check_positive("dual_clip", dual_clip, allow_none=True, minimum=1.0)
    raw, log_ratio = _log_ratio(logp, old_logp, mask, check_positive("log_ratio_clamp", log_ratio_clamp))
    ratio = torch.exp(log_ratio)
    loss, metrics = _clipped_surrogate(ratio, adv, mask, eps_low, eps_high, dual_clip)
    metrics.update(_ratio_metrics(raw, ratio.detach(), mask, log_ratio_clamp))
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo(
    logp, old_logp, adv, mask, *, eps_low: float = 3e-4, eps_high: float = 4e-4,
    log_ratio_clamp: float = LOG_RATIO_CLAMP, **options,
):
    """GSPO: one ratio per sequence, s_i = exp(mean_t (logp - old_logp)), the geometric mean
    of its token ratios, clipped with GSPO's own (much smaller) eps. Every token of sequence
    i carries the same loss -min(s_i A_i, clip(s_i) A_i); aggregated with
    ``seq-mean-token-mean`` this is exactly GSPO's sequence objective. Sequences with no
    valid token give 0."""
    reject_unknown("gspo", options)
    eps_low = check_positive("eps_low", eps_low)
    eps_high = check_positive("eps_high", eps_high)
    clamp = check_positive("log_ratio_clamp", log_ratio_clamp)
    raw, _ = _log_ratio(logp, old_logp, mask, clamp)
    lengths = mask.sum(dim=-1, keepdim=True)
    seq_log_ratio = raw.sum(dim=-1, keepdim=True) / lengths.clamp(min=1)
    seq_raw = seq_log_ratio.expand_as(raw)
    ratio = torch.exp(torch.clamp(seq_raw, -clamp, clamp))
    if adv.shape[-1] != 1:
        raise ValueError("gspo takes one advantage per sequence ([batch]), not per token")
    loss, metrics = _clipped_surrogate(ratio, adv, mask, eps_low, eps_high, None)
    metrics.pop("dual_clip_frac")
    metrics.update(_ratio_metrics(seq_raw.detach(), ratio.detach(), mask, clamp))
    return loss, metrics


@POLICY_LOSSES.register("reinforce")
def reinforce(logp, old_logp, adv, mask, *, log_ratio_clamp: float = LOG_RATIO_CLAMP, **options):
    """Vanilla policy gradient, -A * logp: no ratio, no clip (strictly on-policy). Ratio
    metrics are still reported, from ``old_logp``, to show how on-policy the step was."""
    reject_unknown("reinforce", options)
    clamp = check_positive("log_ratio_clamp", log_ratio_clamp)
    safe_logp = torch.where(mask, logp.float(), torch.zeros_like(logp, dtype=torch.float32))
    loss = torch.where(mask, -adv.float() * safe_logp, torch.zeros_like(safe_logp))
    raw, log_ratio = _log_ratio(logp.detach(), old_logp, mask, clamp)
    return loss, _ratio_metrics(raw, torch.exp(log_ratio), mask, clamp)


@POLICY_LOSSES.register("cispo")
def cispo(
    logp, old_logp, adv, mask, *, ratio_max: float = 5.0, ratio_min: float | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP, **options,
):
    """CISPO (MiniMax-M1, Chen et al. 2025, arXiv 2506.13585): clip the importance-sampling
    weight, not the update, and stop its gradient:

        loss_t = -sg(clip(r_t, ratio_min, ratio_max)) * A_t * logp_t,   r_t = exp(logp_t - old_logp_t)

    so d loss_t / d logp_t = -clip(r_t) * A_t: every token keeps a gradient (PPO's clip
    zeroes it outside the trust region), only its weight is bounded. ``ratio_max`` is
    MiniMax's 1 + eps_high^IS and TRL's ``epsilon_high`` with ``loss_type="cispo"``
    (ScaleRL's eps_max; recommended 5.0); ``ratio_min`` is 1 - eps_low^IS, None for no lower
    bound (MiniMax's setting and TRL's form). Metrics: ``clip_frac_high`` / ``clip_frac_low``
    are the fractions of valid tokens whose weight is clipped at ``ratio_max`` /
    ``ratio_min`` (any advantage sign; TRL's ``cispo_clip_ratio`` counts A > 0 only)."""
    reject_unknown("cispo", options)
    ratio_max = check_positive("ratio_max", ratio_max)
    ratio_min = check_positive("ratio_min", ratio_min, allow_none=True)
    if ratio_min is not None and ratio_min >= ratio_max:
        raise ValueError(f"ratio_min ({ratio_min}) must be < ratio_max ({ratio_max})")
    clamp = check_positive("log_ratio_clamp", log_ratio_clamp)
    raw, log_ratio = _log_ratio(logp.detach(), old_logp, mask, clamp)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, min=ratio_min, max=ratio_max)  # no grad: logp was detached above
    safe_logp = torch.where(mask, logp.float(), torch.zeros_like(logp, dtype=torch.float32))
    loss = torch.where(mask, -weight * adv.float() * safe_logp, torch.zeros_like(safe_logp))
    metrics = _ratio_metrics(raw, ratio, mask, clamp)
    metrics["clip_frac_high"] = masked_mean((ratio > ratio_max).float(), mask)
    low = (ratio < ratio_min) if ratio_min is not None else torch.zeros_like(mask)
    metrics["clip_frac_low"] = masked_mean(low.float(), mask)
    return loss, metrics


@POLICY_LOSSES.register("sapo")
def sapo(
    logp, old_logp, adv, mask, *, temperature_pos: float = 1.0, temperature_neg: float = 1.05,
    log_ratio_clamp: float = LOG_RATIO_CLAMP, **options,
):
    """SAPO, Soft Adaptive Policy Optimization (Qwen, Gao et al. 2025, arXiv 2511.20347): a
    smooth, temperature-controlled gate in place of PPO's hard clip,

        loss_t = -A_t * (4 / tau) * sigmoid(tau * (r_t - 1)),   tau = temperature_pos if A_t > 0
                                                                     else temperature_neg

    whose gradient weight on r_t is 4 p (1 - p), p = sigmoid(tau (r_t - 1)): exactly 1
    on-policy (r = 1, the plain policy gradient) and decaying smoothly as the ratio leaves
    1, faster for larger tau (negative advantages get the larger default, 1.05, as in the
    paper and TRL's ``sapo_temperature_neg`` / ``sapo_temperature_pos``). Metric
    ``sapo_gate_mean``: the mean gradient weight 4 p (1 - p) over valid tokens (1 = no
    attenuation)."""
    reject_unknown("sapo", options)
    tau_pos = check_positive("temperature_pos", temperature_pos)
    tau_neg = check_positive("temperature_neg", temperature_neg)
    clamp = check_positive("log_ratio_clamp", log_ratio_clamp)
    raw, log_ratio = _log_ratio(logp, old_logp, mask, clamp)
    ratio = torch.exp(log_ratio)
    adv = adv.float()
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = torch.where(mask, -adv * gate * (4.0 / tau), torch.zeros_like(ratio))
    metrics = _ratio_metrics(raw, ratio.detach(), mask, clamp)
    with torch.no_grad():
        metrics["sapo_gate_mean"] = masked_mean((4.0 * gate * (1.0 - gate)).expand_as(ratio), mask)
    return loss, metrics


def policy_loss(name: str, logp, old_logp, advantages, mask, **options):
    """Per-token policy loss ``name`` (see :data:`POLICY_LOSSES`) and its metrics.

    Args:
        logp: [B, T] trainer log-probs (fp32 from :func:`portarl.ops.logprobs`), with grad.
        old_logp: [B, T] log-probs of the policy that sampled (no grad is taken).
        advantages: [B] (per sequence) or [B, T] (per token).
        mask: [B, T] bool (or 0/1) response mask.
        options: the loss's own options (``eps_low``, ``eps_high``, ``dual_clip``,
            ``ratio_max``, ``ratio_min``, ``temperature_pos``, ``temperature_neg``,
            ``log_ratio_clamp``).
    """
    from portarl.core._checks import check_mask, check_tokens, per_sequence

    check_tokens("logp", logp)
    check_tokens("old_logp", old_logp, logp)
    mask = check_mask(mask, logp)
    adv = per_sequence("advantages", advantages, logp.shape[0]).to(logp.device)
    adv = torch.where(mask, adv, torch.zeros_like(adv, dtype=torch.float32)) if adv.shape == mask.shape else adv
    return POLICY_LOSSES.get(name)(logp, old_logp.detach(), adv.detach(), mask, **options)
