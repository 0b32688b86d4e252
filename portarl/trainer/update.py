"""Update phase of one GRPO iteration: optimizer steps over the scored batch, each
accumulating gradients over micro-batches of :func:`portarl.core.compute_loss` with global
normalisers (token and sequence counts summed over ranks), then the learning-rate schedule.
"""

from __future__ import annotations

import math

import torch

from portarl import distributed as pdist
from portarl.core import compute_loss, sequence_count, token_count
from portarl.trainer.guards import NonFiniteError, first_nonfinite_gradient
from portarl.trainer.scoring import logprobs


def lr_lambda(cfg, total: int):
    """LR factor per optimizer step: linear warm-up, then constant or cosine to min_lr_ratio."""
    warm, floor = cfg.optim.warmup_steps, cfg.optim.min_lr_ratio

    def factor(i: int) -> float:
        if warm and i < warm:
            return (i + 1) / warm
        if cfg.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (i - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def run_update(trainer, scored, metrics: dict) -> bool:
    """``ppo_epochs`` optimizer steps over the batch; returns whether the last overflowed
    (fp16 dynamic loss scale)."""
    overflow = False
    for _ in range(trainer.config.train.ppo_epochs):
        step_metrics, overflow = optimizer_step(trainer, scored.batch, scored.old_logp, scored.ref_logp,
                                                scored.rollout_logp, scored.advantages)
        metrics.update(step_metrics)
    return overflow


def optimizer_step(trainer, batch, old_logp, ref_logp, rollout_logp, advantages) -> tuple[dict, bool]:
    """One optimizer step over the whole batch (micro-batched). Returns (metrics, overflow)."""
    cfg = trainer.config
    dist, precision = trainer.dist, trainer.precision
    mb = cfg.train.micro_batch_size
    n = batch.labels.shape[0]
    counts = pdist.all_reduce(dist, torch.tensor([float(token_count(batch.mask)), float(sequence_count(batch.mask))]))
    norms = dict(num_global_tokens=int(counts[0]), num_global_seqs=int(counts[1]))
    want_entropy = True  # cheap with the fused op; logged, and in the loss when entropy_coef > 0
    precision.zero_grad()
    sums: dict[str, float] = {}
    for start in range(0, n, mb):
        rows = slice(start, start + mb)
        part = batch.rows(rows)
        out = logprobs(trainer, trainer.model, part, with_entropy=want_entropy)
        logp, entropy = out if want_entropy else (out, None)
        loss, metrics = compute_loss(
            logp, old_logp[rows], advantages[rows], part.mask, config=cfg.loss,
            ref_logp=None if ref_logp is None else ref_logp[rows],
            rollout_logp=None if rollout_logp is None else rollout_logp[rows],
            entropy=entropy, **norms,
        )
        loss = trainer._apply_hooks("loss", loss)
        trainer.guard.check("loss", loss)
        # FSDP2 averages gradients over ranks; each rank's loss is its share of the global
        # loss, so scale by the world size to reduce to the global batch's gradient.
        precision.scale_loss(loss * dist.world_size if dist.enabled else loss).backward()
        share = part.labels.shape[0] / n
        for k, v in metrics.items():
            if k == "loss" or k.endswith("/loss"):
                sums[k] = sums.get(k, 0.0) + float(v)  # already a share of the batch loss
            else:
                sums[k] = sums.get(k, 0.0) + share * float(v)
    params = precision.params
    if trainer.hooks["grad"] and params[0].grad is not None:
        params[0].grad = trainer._apply_hooks("grad", params[0].grad)
    bad = first_nonfinite_gradient(trainer.model)
    if dist.enabled:
        if bad is not None:
            trainer.guard.record("gradient")
        trainer.guard.sync()
    if bad is not None:
        if precision.dynamic:
            precision.update_scale(overflow=True)
            precision.zero_grad()
            return {**sums, "precision/overflow": 1.0, "precision/loss_scale": precision.scale}, True
        raise NonFiniteError("gradient", f"parameter {bad}")
    precision.unscale_grads()
    targets = precision.optimizer_params()
    clip = cfg.optim.grad_clip
    grad_norm = torch.nn.utils.clip_grad_norm_(targets, clip if clip is not None else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # DTensor under FSDP2: the global norm
        grad_norm = grad_norm.full_tensor()
    if not torch.isfinite(grad_norm):
        raise NonFiniteError("gradient", "norm")
    trainer.optimizer.step()
    trainer.rollout.mark_trainer_updated()
    trainer.scheduler.step()
    precision.after_step()
    precision.update_scale(overflow=False)
    precision.zero_grad()
    sums["grad_norm"] = float(grad_norm)
    sums["precision/loss_scale"] = precision.scale
    return sums, False
