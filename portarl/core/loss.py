"""``compute_loss``: the one entry point combining advantages' use, policy loss, KL,
entropy, aggregation, mismatch correction and the non-finite guard from a GRPOConfig."""

from __future__ import annotations

import torch

from portarl.core._checks import check_mask, check_tokens, masked_mean
from portarl.core.aggregation import aggregate_loss
from portarl.core.config import GRPOConfig
from portarl.core.entropy_mask import high_entropy_mask
from portarl.core.kl import kl_per_token
from portarl.core.mismatch import correct_mismatch
from portarl.core.policy_losses import policy_loss


def compute_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: GRPOConfig,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_global_tokens: int | None = None,
    num_global_seqs: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar fp32 loss and metrics (detached 0-dim tensors; no host sync) for one batch.

    loss = agg(w * pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy), every ``agg``
    the same :func:`aggregate_loss` call (mode and global normalisers), where w are the
    rollout-mismatch weights (1 without ``rollout_logp``).

    Args:
        logp: [B, T] trainer log-probs (with grad).
        old_logp: [B, T] log-probs of the behaviour policy as recomputed by the trainer.
        advantages: [B] or [B, T] (from :func:`compute_advantages`).
        mask: [B, T] response mask.
        config: a :class:`GRPOConfig`.
        ref_logp: [B, T] reference log-probs; required when ``kl_coef > 0`` and the KL is a
            loss term.
        rollout_logp: [B, T] rollout-engine log-probs; enables mismatch correction.
        entropy: [B, T] per-token entropy; required when ``entropy_coef > 0`` or
            ``top_entropy_quantile < 1`` (entropy masking: only the top-q tokens of this
            batch by entropy keep a policy gradient, :mod:`portarl.core.entropy_mask`).
        num_global_tokens, num_global_seqs: normalisers over the whole optimizer batch
            (micro-batching / data parallel); default: this batch's own counts.
    """
    if not isinstance(config, GRPOConfig):
        raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
    check_tokens("logp", logp)
    check_tokens("old_logp", old_logp, logp)
    mask = check_mask(mask, logp)
    metrics: dict[str, torch.Tensor] = {}

    # Stability guard: a non-finite log-prob on a valid token would poison the whole step.
    finite = torch.isfinite(logp.detach()) & torch.isfinite(old_logp)
    bad = mask & ~finite
    metrics["guard/nonfinite_token_frac"] = masked_mean(bad.float(), mask).detach()
    if not config.drop_nonfinite_tokens and bool(bad.any()):
        raise FloatingPointError(
            f"{int(bad.sum())} valid token(s) have non-finite logp/old_logp; set drop_nonfinite_tokens=True "
            "to leave them out, or find where the log-probs go bad (check the logits for NaN)"
        )
    mask = mask & finite
    lengths = mask.sum(dim=-1)
    metrics["guard/empty_seq_frac"] = (lengths == 0).float().mean() if lengths.numel() else lengths.new_zeros((), dtype=torch.float32)

    agg = dict(
        mode=config.loss_agg_mode, num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs,
        max_response_length=config.max_response_length,
    )

    weights = None
    if rollout_logp is not None:
        corr = correct_mismatch(
            old_logp, rollout_logp, mask, config.mismatch_mode, truncate_c=config.mismatch_truncate_c,
            mask_low=config.mismatch_mask_low, mask_high=config.mismatch_mask_high,
        )
        metrics.update(corr.metrics)
        if config.mismatch_mode is not None:
            weights, mask = corr.weights, corr.mask

    pg, pg_metrics = policy_loss(config.policy_loss, logp, old_logp, advantages, mask, **config.policy_loss_options())
    metrics.update({f"pg/{k}": v.detach() for k, v in pg_metrics.items()})
    if config.top_entropy_quantile < 1:
        # Entropy masking (TRL's top_entropy_quantile): the policy gradient of the low-entropy
        # tokens is dropped; they stay in the normaliser, the KL and the entropy terms, as in TRL.
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs entropy (ops.logprobs(..., return_entropy=True))")
        check_tokens("entropy", entropy, logp)
        keep = high_entropy_mask(entropy, mask, config.top_entropy_quantile)
        pg = torch.where(keep, pg, torch.zeros_like(pg))
        metrics["pg/entropy_kept_frac"] = masked_mean(keep.float(), mask).detach()
    if weights is not None:
        pg = pg * weights
    pg_loss = aggregate_loss(pg, mask, **agg)
    loss = pg_loss
    metrics["pg/loss"] = pg_loss.detach()

    if config.kl_coef > 0 and not config.kl_in_reward:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (reference log-probs), or set kl_in_reward / kl_coef=0")
        kl, kl_mask, kl_metrics = kl_per_token(
            logp, ref_logp, mask, estimator=config.kl_estimator,
            log_ratio_clamp=config.kl_log_ratio_clamp, max_value=config.kl_max_value,
        )
        kl_loss = aggregate_loss(kl, kl_mask, **agg)
        loss = loss + config.kl_coef * kl_loss
        metrics.update(kl_metrics)
        metrics["kl/loss"] = kl_loss.detach()
    elif ref_logp is not None:
        with torch.no_grad():
            _, _, kl_metrics = kl_per_token(logp.detach(), ref_logp, mask, estimator=config.kl_estimator)
        metrics.update(kl_metrics)

    if entropy is not None:
        check_tokens("entropy", entropy, logp)
        ent = aggregate_loss(entropy, mask, **agg)
        metrics["entropy"] = ent.detach()
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * ent
    elif config.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs entropy (ops.logprobs(..., return_entropy=True))")

    metrics["loss"] = loss.detach()
    return loss, metrics
