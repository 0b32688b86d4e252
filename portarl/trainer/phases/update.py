"""Update phase of one GRPO iteration: ``ppo_epochs`` passes over the scored batch, each
split into ``mini_batches`` shuffled mini-batches, one optimizer step per mini-batch.

Each optimizer step accumulates gradients over micro-batches of
:func:`portarl.core.compute_loss`, normalised by that mini-batch's own global token and
sequence counts (summed over ranks), then runs the step's guards in order: loss,
gradient, spike (grad norm, KL), the optimizer update itself
(:func:`portarl.trainer.guards.step_guard.guarded_optimizer_step`).

A guard that trips in optimizer step k ends the iteration there: steps 1..k-1 stay
applied, step k is not (gradients dropped, or the update restored bitwise), and the
event says exactly that. The LR schedule advances once per applied optimizer step.
"""

from __future__ import annotations

import contextlib
import math
import random

import torch

from portarl.runtime import distributed as pdist
from portarl.core import compute_loss
from portarl.trainer.guards.detectors import GuardTripped, NonFiniteError, first_nonfinite_gradient
from portarl.trainer.memory.heap import GradientsFirst, release_freed_memory
from portarl.trainer.phases.micro_batches import micro_batches, rows_of
from portarl.trainer.phases.scoring import logprobs
from portarl.trainer.guards.step_guard import guarded_optimizer_step, judge_spikes

#: Metrics also logged as ``<key>/first`` and ``<key>/last`` over an iteration's optimizer
#: steps when there are several (the plain key is their mean): the first step is on-policy
#: (ratio 1, no clipping), the later ones show what the clip range does.
TRACKED = ("loss", "pg/loss", "pg/clip_frac_low", "pg/clip_frac_high", "pg/approx_kl", "grad_norm", "entropy")


def lr_lambda(cfg, total: int):
    """LR factor per optimizer step: linear warm-up (``warmup_steps``, or ``warmup_ratio``
    of ``total`` optimizer steps), then constant or cosine down to ``min_lr_ratio``."""
    warm = cfg.optim.warmup_steps or int(round(cfg.optim.warmup_ratio * total))
    floor = cfg.optim.min_lr_ratio

    def factor(i: int) -> float:
        if warm and i < warm:
            return (i + 1) / warm
        if cfg.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (i - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def optimizer_steps_total(cfg) -> int:
    return cfg.train.steps * cfg.train.ppo_epochs * cfg.train.mini_batches


def mini_batch_rows(n: int, mini_batches: int, seed: int, step: int, epoch: int) -> list[torch.Tensor | slice]:
    """Row sets of one pass: a permutation seeded by (run seed, step, epoch), independent of
    the global RNG (so a resumed run shuffles identically), cut into ``mini_batches`` near
    equal parts. One mini-batch: the batch in its order (no shuffle, nothing to change)."""
    if mini_batches == 1:
        return [slice(0, n)]
    gen = torch.Generator().manual_seed(random.Random(f"{seed}/mini_batches/{step}/{epoch}").getrandbits(62))
    perm = torch.randperm(n, generator=gen)
    return [part for part in torch.tensor_split(perm, mini_batches) if part.numel()]


def run_update(trainer, scored, metrics: dict, events: list) -> bool:
    """All optimizer steps of the iteration; fills ``metrics`` and ``events``. Returns
    whether the last step overflowed (fp16 dynamic loss scale). Raises the guard's error
    when the first optimizer step trips (the iteration is skipped, nothing applied)."""
    cfg = trainer.config.train
    n = scored.batch.labels.shape[0]
    total = cfg.ppo_epochs * cfg.mini_batches
    done: list[dict] = []
    overflow = False
    index = 0
    for epoch in range(cfg.ppo_epochs):
        for k, rows in enumerate(mini_batch_rows(n, cfg.mini_batches, cfg.seed, trainer.hook_step, epoch)):
            index += 1
            try:
                step_metrics, overflow = optimizer_step(
                    trainer, scored.batch.rows(rows), None if scored.old_logp is None else scored.old_logp[rows],
                    None if scored.ref_logp is None else scored.ref_logp[rows], scored.rollout_logp[rows],
                    scored.advantages[rows],
                )
            except GuardTripped as err:
                if not done:
                    raise
                trainer.precision.zero_grad()
                metrics.update(_combine(done, total))
                metrics["update/applied_steps"] = len(done)
                metrics["guard/nonfinite_tensor"] = err.tensor_name
                events.append(("partial_update", (
                    f"optimizer step {index} of {total} (epoch {epoch + 1}, mini-batch {k + 1}) skipped: {err}; "
                    f"the iteration's first {len(done)} optimizer steps stay applied, the step that tripped changed "
                    f"nothing and the remaining {total - index} were not run"), {"tensor": err.tensor_name}))
                trainer.partial_update = err
                return overflow
            step_metrics.update({"update/epoch": epoch, "update/mini_batch": k})
            done.append(step_metrics)
            _nonfinite_logp_event(trainer, step_metrics, index, total)
    metrics.update(_combine(done, total))
    metrics["update/applied_steps"] = len(done)
    return overflow


def _nonfinite_logp_event(trainer, step_metrics: dict, index: int, total: int) -> None:
    """compute_loss leaves tokens with a non-finite current-policy log-prob out of the loss
    (``drop_nonfinite_tokens``); that must be seen, not only counted."""
    frac = step_metrics.get("guard/nonfinite_token_frac", 0.0)
    if frac > 0 and not any(kind == "nonfinite_logp" for kind, _, _ in trainer.guard.events):
        trainer.guard.events.append(("nonfinite_logp", (
            f"{frac:.2%} of the response tokens had a non-finite current-policy (or old) log-prob in optimizer step "
            f"{index} of {total}; they were left out of the loss (loss.drop_nonfinite_tokens). Check the logits for "
            "NaN/inf (overflow in the forward, low-precision weights)"), {"value": frac}))


def _combine(done: list[dict], total: int) -> dict:
    """Mean over optimizer steps as the plain key; first / last of TRACKED keys when
    the iteration has several optimizer steps."""
    out: dict = {}
    keys = [k for k in done[0] if k not in ("update/epoch", "update/mini_batch")]
    for key in keys:
        values = [d[key] for d in done if key in d]
        out[key] = sum(values) / len(values)
        if total > 1 and key in TRACKED:
            out[f"{key}/first"], out[f"{key}/last"] = values[0], values[-1]
    if "precision/loss_scale" in out:
        out["precision/loss_scale"] = done[-1]["precision/loss_scale"]
    return out


def _to_host(values: list[torch.Tensor]) -> list[float]:
    """The device-to-host transfer of an optimizer step's results: its metrics, guard
    counters and grad norm, stacked (tests count the calls). The only other one is the
    step's token / sequence counts, read before the forward passes (the loss normalisers)."""
    return torch.stack([v.detach().float().reshape(()) for v in values]).tolist()


def grad_norm_of(targets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm, global_norm)``: the L2 norm of the gradients of ``targets`` as
    ``clip_grad_norm_`` computes it (``norm``, a DTensor under FSDP2, what clipping takes)
    and as a plain 0-d tensor over every rank (``global_norm``). No host sync: a
    non-finite gradient anywhere makes it non-finite, which is how the gradient guard
    sees it (the parameter is searched for only then)."""
    grads = [t.grad for t in targets if t.grad is not None]
    if not grads:
        zero = torch.zeros((), device=targets[0].device if targets else None)
        return zero, zero
    norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)  # as clip_grad_norm_ does
    return norm, pdist.full(norm)


def _refuse_old_logp(trainer, on_policy: list, bad: int) -> None:
    """Non-finite old log-probs taken from the training forward: name the logits when the
    model itself produced NaN/inf (as scoring does), else ``old_logp``. Runs only on failure."""
    for part, old in on_policy:
        if bool((~torch.isfinite(old) & part.mask).any()):
            trainer.guard.blame_logits(trainer, part, old)
    total = sum(int(part.mask.sum()) for part, _ in on_policy)
    raise NonFiniteError("old_logp", f"{bad} of {total} values")


def router_tap(trainer, coef: float):
    """The trainer's :class:`portarl.moe.load.RouterTap` on its MoE model's routers, made
    once, its counts reset for this optimizer step (the aux loss's logits kept only with
    ``loss.router_aux_coef`` > 0); None for a dense model."""
    from portarl.moe.load import RouterTap

    tap = getattr(trainer, "router_tap", False)
    if tap is False:
        tap = RouterTap(trainer.model)
        tap = trainer.router_tap = tap.open() if tap.routers else None
    if tap is not None:
        tap.reset(aux=coef > 0)
    return tap


def _router_terms(trainer, tap, part, loss: torch.Tensor, metrics: dict, coef: float, rows: int) -> torch.Tensor:
    """Count the micro-batch's expert load; with ``coef`` > 0 (``loss.router_aux_coef``)
    add the load-balancing loss of the ranks' micro-batches together and log it
    (``moe/aux_loss``): its statistics and rows are summed over ranks (one collective per
    micro-batch, which every rank runs as many of), each rank adds its term
    (:meth:`portarl.moe.load.RouterTap.aux_from`: the terms add up to the loss), weighted
    by the global micro-batch's share of the mini-batch's rows (``rows`` this rank's)."""
    from portarl.moe.load import real_tokens

    real = real_tokens(part)
    tap.count(real)
    if not tap.aux:
        return loss
    local = tap.aux_statistics(real)
    sizes = torch.tensor([part.labels.shape[0], rows], dtype=torch.float32, device=local.device)
    total = pdist.all_reduce(trainer.dist, torch.cat([local.detach(), sizes]))
    term, value = tap.aux_from(local, total[:-2])
    metrics["moe/aux_loss"] = value
    # FSDP2 averages gradients over ranks and each rank's loss is scaled by the world size
    # (optimizer_step): the ranks' terms, added up, get the weight ``coef x share``.
    return loss + coef * (total[-2] / total[-1]) * term


def optimizer_step(trainer, batch, old_logp, ref_logp, rollout_logp, advantages) -> tuple[dict, bool]:
    """One optimizer step over ``batch`` (micro-batched). Returns (metrics, overflow).
    ``old_logp`` None: each micro-batch's training forward, detached, is its old log-probs
    (hooked and guarded as in scoring).

    Host syncs: the micro-batches' metrics stay 0-d device tensors, and the ``old_logp``
    (on-policy) and ``loss`` guards are device counters; all travel to the host with the
    grad norm in one transfer (:func:`_to_host`) after the backward passes (the token and
    sequence counts, needed first as loss normalisers, are the step's other). The guards are
    then judged in their order, ``old_logp``, ``loss``, ``gradient`` (from the grad norm:
    the fp16 overflow; the parameter is named only when the norm is not finite); a refused
    step's gradients are dropped, never applied."""
    cfg = trainer.config
    dist, precision = trainer.dist, trainer.precision
    n = batch.labels.shape[0]
    mask = batch.mask.bool()  # token_count / sequence_count, in one transfer
    counts = pdist.all_reduce(dist, torch.stack([mask.sum(), mask.any(dim=-1).sum()]).to(torch.float32)).tolist()
    sp = getattr(trainer, "sp", None)
    if sp is not None:  # every rank of a sequence-parallel group holds the same rows: count them once
        counts = [c / sp.size for c in counts]
    norms = dict(num_global_tokens=int(counts[0]), num_global_seqs=int(counts[1]))
    loss_cfg = trainer.loss_config()
    want_entropy = True  # cheap with the fused op; logged, and in the loss when entropy_coef > 0
    precision.zero_grad()
    grads = GradientsFirst(precision.params)  # below the activations in the heap (trainer/memory/heap.py)
    sums: dict[str, torch.Tensor] = {}
    loss_ok = torch.ones((), dtype=torch.bool, device=batch.labels.device)
    old_bad = torch.zeros((), dtype=torch.int64, device=batch.labels.device)
    on_policy: list = []  # (micro-batch, old log-probs from its training forward)
    tap = router_tap(trainer, loss_cfg.router_aux_coef)  # an MoE model's expert load (and aux loss)
    for rows, part in micro_batches(trainer, batch):  # fixed slices, or a token budget (micro_batches.py)
        with tap.forward() if tap is not None else contextlib.nullcontext():
            out = logprobs(trainer, trainer.model, part, with_entropy=want_entropy)
        logp, entropy = out if want_entropy else (out, None)
        if old_logp is None:  # the current policy is the old (proximal) one: scoring.old_logprobs_recompute_reason
            old = trainer.run_hooks("old_logp", logp.detach())
            old_bad = old_bad + (~torch.isfinite(old) & part.mask).sum()
            on_policy.append((part, old))
        else:
            old = rows_of(old_logp, rows, part)
        loss, metrics = compute_loss(
            logp, old, rows_of(advantages, rows, part), part.mask, config=loss_cfg,  # [B] or per token [B, T]
            ref_logp=rows_of(ref_logp, rows, part), rollout_logp=rows_of(rollout_logp, rows, part),
            entropy=entropy, **norms,
        )
        share = part.labels.shape[0] / n
        if tap is not None:
            loss = _router_terms(trainer, tap, part, loss, metrics, loss_cfg.router_aux_coef, n)
        loss = trainer.run_hooks("loss", loss)
        loss_ok = loss_ok & torch.isfinite(loss.detach())
        # FSDP2 averages gradients over ranks; each rank's loss is its share of the global
        # loss, so scale by the world size to reduce to the global batch's gradient. Under
        # sequence parallelism each rank's backward gives its shard's part of its group's
        # loss gradient (portarl.runtime.sequence_parallel.sum_over_group), the parts sum to
        # it, and the world mean x the world size is again the global batch's gradient.
        precision.scale_loss(loss * dist.world_size if dist.enabled else loss).backward()
        release_freed_memory()  # this micro-batch's activations, before the next one's forward
        for k, v in metrics.items():
            v = torch.as_tensor(v, dtype=torch.float32).detach()
            v = v if k == "loss" or k.endswith("/loss") else v * share  # a loss is already a share of the batch's
            sums[k] = sums[k] + v if k in sums else v
    if tap is not None and tap.counts is not None:  # the step's real tokens per expert, over every rank
        sums["moe/load_imbalance"] = tap.imbalance(pdist.all_reduce(dist, tap.counts))
    grads.drop_untouched()
    params = precision.params
    if trainer.hooks["grad"] and params[0].grad is not None:
        params[0].grad = trainer.run_hooks("grad", params[0].grad)
    precision.unscale_grads()  # fp16: inf / NaN survive the unscale, so the norm below sees an overflow
    targets = precision.optimizer_params()
    norm, global_norm = grad_norm_of(targets)
    keys = list(sums)
    host = _to_host([old_bad, loss_ok, global_norm, *(sums[k] for k in keys)])
    bad_old, finite_loss, finite = int(host[0]), bool(host[1]), math.isfinite(host[2])
    metrics_out = dict(zip(keys, host[3:]))
    if dist.enabled:
        # an fp16 overflow under the dynamic scale is a skipped step, not a guard failure (below)
        for name, failed in (("old_logp", bad_old), ("loss", not finite_loss),
                             ("gradient", not finite and not precision.dynamic)):
            if failed:
                trainer.guard.record(name)
        trainer.guard.sync()
    elif bad_old:
        _refuse_old_logp(trainer, on_policy, bad_old)
    elif not finite_loss:
        raise NonFiniteError("loss", "in at least one micro-batch")
    if not finite:
        if precision.dynamic:
            precision.update_scale(overflow=True)
            precision.zero_grad()
            return {**metrics_out, "precision/overflow": 1.0, "precision/loss_scale": precision.scale}, True
        bad = first_nonfinite_gradient(trainer.model)
        raise NonFiniteError("gradient", f"parameter {bad}" if bad is not None else "norm")
    clip = cfg.optim.grad_clip
    if clip is not None:
        torch.nn.utils.clip_grads_with_norm_(targets, clip, norm)
    metrics_out["grad_norm"] = host[2]
    judge_spikes(trainer, metrics_out)  # before the update: "skip" / "stop" must leave the weights as they are
    metrics_out.update(guarded_optimizer_step(trainer))
    if trainer.rollout_if_built is not None:  # an engine not built yet has nothing stale (async mode: the worker's
        trainer.rollout_if_built.mark_trainer_updated()  # engine; building one here would start a second vLLM)
    trainer.scheduler.step()
    precision.update_scale(overflow=False)
    precision.zero_grad()
    metrics_out["precision/loss_scale"] = precision.scale
    return metrics_out, False


__all__ = ["TRACKED", "lr_lambda", "mini_batch_rows", "optimizer_step", "optimizer_steps_total", "run_update"]

