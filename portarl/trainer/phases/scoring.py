"""Scoring phase of one GRPO iteration: rewards, the batch, old (and reference) log-probs,
the optional KL-in-reward penalty, and group advantages.

Every tensor is named and guarded (:class:`portarl.trainer.guards.step_guard.StepGuard`) as soon
as it exists; a non-finite one raises :class:`~portarl.trainer.guards.detectors.NonFiniteError` and
the iteration is skipped before any optimizer step.

Old log-probs (``train.old_logprobs``): with ``auto`` (default) the no-grad forward that
scores the batch under the trainer is skipped when its numbers would equal the training
forward's, and the update takes ``old_logp = logp.detach()`` from that forward instead
(:func:`portarl.trainer.phases.update.optimizer_step`; same hook, guard and logit blame, per
micro-batch, judged with the step's one host transfer before anything is applied: a
non-finite value refuses the step and its gradients are dropped; every mismatch metric
then compares the rollout's log-probs with the training forward). :func:`old_logprobs_recompute_reason` says when the
extra forward still runs: ``recompute``; several optimizer steps per rollout
(``ppo_epochs x mini_batches > 1``: later steps need the pre-update policy); a KL penalty in
the reward (``loss.kl_in_reward``: old log-probs are needed before the update); the NPU
numerics emulation (it reproduces a stack that scores old log-probs in their own pass);
an engine that did not sample the trainer's current weights (a replayed file, a vLLM
engine not synced since the last optimizer step, any engine that does not say so through
:meth:`~portarl.rollout.RolloutEngine.samples_policy_of`). In ``rollout.mode=async`` the
worker sampled its own copy of the weights, up to ``rollout.max_staleness`` steps old
(:mod:`portarl.trainer.asynchronous.pipeline`): its log-probs are the behaviour policy's, the old
(proximal) log-probs the trainer's current policy's, and with one optimizer step per batch
those are the training forward's, detached (decoupled PPO): no extra forward either.

The reward call is ``GRPOTrainer.score_rewards`` (:mod:`portarl.assets.reward_runner`: per-sample and
TRL-style batched rewards with dataset columns, errors naming the reward and the sample),
except in async mode, where the worker scored the batch (``RolloutPhase.scores``).
"""

from __future__ import annotations

import dataclasses

import torch

from portarl.runtime import distributed as pdist
from portarl.core import compute_advantages, kl_penalized_rewards
from portarl.trainer.phases.episodes import reward_examples
from portarl.trainer.guards.detectors import NonFiniteError, check_finite
from portarl.trainer.phases.micro_batches import micro_batches
from portarl.trainer.phases.reference import reference_model
from portarl.trainer.phases.sequences import build_batch, completion_logprobs, padded
from portarl.trainer.phases.ulysses import sp_completion_logprobs
from portarl.trainer.phases.shaping import shape_rewards, truncated_keep


@dataclasses.dataclass
class Scored:
    batch: object                      # SequenceBatch; mask already excludes dropped groups
    old_logp: torch.Tensor | None      # [B, T] fp32, no grad: the rollout policy under the trainer;
                                       # None: the update takes it from the training forward
    ref_logp: torch.Tensor | None      # [B, T] fp32 or None when no KL to a reference
    rollout_logp: torch.Tensor         # [B, T] fp32: the engine's own log-probs
    advantages: torch.Tensor           # [B], or [B, T] (gae, distillation: per token)
    values: torch.Tensor | None = None   # [B, T] the critic's old values (loss.advantage_estimator: gae)
    returns: torch.Tensor | None = None  # [B, T] the value targets (gae)


def logprobs(trainer, model, batch, *, with_entropy=False):
    """Per-token log-probs (and entropy) of ``batch`` under ``model``; under sequence
    parallelism (``trainer.sp``) each rank's forward runs on its shard of every row
    (:func:`portarl.trainer.phases.ulysses.sp_completion_logprobs`)."""
    cfg = trainer.config
    sp = getattr(trainer, "sp", None)
    if sp is not None:
        return sp_completion_logprobs(model, batch, sp, temperature=cfg.rollout.temperature,
                                      logits_policy=cfg.precision.logits, with_entropy=with_entropy)
    return completion_logprobs(model, batch, temperature=cfg.rollout.temperature, logits_policy=cfg.precision.logits,
                               with_entropy=with_entropy, emulate=trainer.emulate)


def no_grad_logprobs(trainer, model, batch, record=None) -> torch.Tensor:
    """fp32 log-probs [B, T] of ``batch`` without autograd, in the update's micro-batches
    (:func:`portarl.trainer.phases.micro_batches.micro_batches`: the same token budget bounds them).
    ``record`` (routing replay R2, :mod:`portarl.moe.old_routing`): a batch's RoutingRows
    that gets the experts every MoE layer chose for each token."""
    out = torch.zeros(batch.labels.shape, dtype=torch.float32, device=batch.labels.device)
    with torch.no_grad():
        for rows, part in micro_batches(trainer, batch):
            if record is None:
                out[rows, : part.labels.shape[1]] = logprobs(trainer, model, part)
                continue
            from portarl.moe.old_routing import part_routing, place
            from portarl.moe.routing import recording

            with recording(model) as calls:
                out[rows, : part.labels.shape[1]] = logprobs(trainer, model, part)
            chosen = torch.stack([layer[-1] for layer in calls])  # [layers, tokens, k]: this forward's
            place(record, rows, part, part_routing(chosen, part), batch.prompt_width)
    return out


def old_routing(trainer, batch):
    """Routing replay R2: an empty RoutingRows of ``batch`` for the old log-prob forward to
    fill (:mod:`portarl.moe.old_routing`), or None when R2 is off."""
    if trainer.config.rollout.routing_replay != "old":
        return None
    from portarl.moe.old_routing import empty_rows
    from portarl.moe.routing import routers

    found = routers(trainer.model)
    return empty_rows(len(found), batch.input_ids.shape[0], batch.input_ids.shape[1], found[0].top_k,
                      batch.input_ids.device)


def old_logprobs_recompute_reason(trainer) -> str | None:
    """Why the old log-probs need their own no-grad forward this iteration, or None when
    the training forward gives the same numbers (see the module docstring)."""
    cfg = trainer.config
    if cfg.train.old_logprobs == "recompute":
        return "train.old_logprobs=recompute"
    if cfg.train.ppo_epochs * cfg.train.mini_batches > 1:
        return "several optimizer steps per rollout (train.ppo_epochs x train.mini_batches > 1)"
    if trainer.uses_reference() and cfg.loss.kl_in_reward:
        return "loss.kl_in_reward needs old log-probs before the update"
    if trainer.emulate:
        return "precision.numerics emulation"
    if cfg.rollout.mode == "async":
        # Decoupled PPO: the worker sampled a copy of the weights, possibly older ones, whose
        # log-probs are the rollout's (the behaviour policy, weighed by the mismatch
        # correction); the proximal policy is the trainer's current one, which with one
        # optimizer step per batch is exactly the training forward's, detached.
        return None
    if not trainer.rollout.samples_policy_of(trainer.model):
        return f"the {getattr(trainer.rollout, 'name', 'rollout')} engine did not sample the trainer's current weights"
    return None


def check_old_logp(trainer, batch, old_logp: torch.Tensor) -> None:
    """The ``old_logp`` guard; when it trips, blame the logits if the model produced NaN/inf."""
    try:
        trainer.guard.check("old_logp", old_logp, batch.mask)
    except NonFiniteError:
        trainer.guard.blame_logits(trainer, batch, old_logp)
        raise


def score(trainer, phase, metrics: dict) -> Scored:
    """Rewards -> batch -> old/ref log-probs -> advantages for the rollout ``phase``
    (:class:`~portarl.trainer.phases.rollout.RolloutPhase`); adds to ``metrics``."""
    cfg = trainer.config
    g = cfg.rollout.group_size
    guard = trainer.guard
    rollout, examples = phase.rollout, phase.examples
    if phase.rewards is not None:  # dynamic sampling scored (and shaped) them while choosing groups
        rewards, reward_metrics, reward_values = phase.rewards, {}, phase.reward_values
    else:
        if phase.scores is None:
            agent = getattr(trainer, "agent", None)
            rows = None if agent is None else reward_examples(  # multi-turn: per-sample columns
                examples, g, rollout, bool(agent.factories))
            scores = trainer.score_rewards(examples, phase.texts, rows)
            rewards, reward_metrics = scores.total, scores.metrics
        else:  # scored by the rollout worker (rollout.mode=async)
            scores = phase.scores
            rewards, reward_metrics = scores.total, dict(scores.metrics)
        reward_values = scores.per_function
        rewards = shape_rewards(cfg, rewards, rollout.completion_ids, reward_metrics)  # DAPO overlong penalty
    # What the sample log shows (samples.jsonl): filled in as the phase goes.
    trainer.last_samples = {"prompts": [examples[i // g].prompt_text for i in range(len(phase.texts))],
                            "completions": phase.texts, "finished": rollout.finished,
                            "rewards": reward_values, "total": rewards.tolist(),
                            "advantages": None, "episodes": getattr(rollout, "episodes", None),
                            "prompt_ids": rollout.prompt_ids, "completion_ids": rollout.completion_ids,
                            "model_mask": getattr(rollout, "model_mask", None)}
    metrics.update(reward_metrics)
    rewards = trainer.run_hooks("reward", rewards)
    guard.check("reward", rewards)
    batch = build_batch(rollout.prompt_ids, rollout.completion_ids, trainer.codec.pad_token_id, trainer.device,
                        model_mask=getattr(rollout, "model_mask", None),  # multi-turn: the model's tokens only
                        vision=trainer.vision_inputs(examples, g),  # a vision-language model's pixels and positions
                        routing=getattr(rollout, "routed_experts", None))  # MoE routing replay: the engine's experts
    rollout_logp = padded(rollout.logprobs, batch.labels.shape[1], 0.0, torch.float32).to(trainer.device)
    old_logp = old_routes = None
    if old_logprobs_recompute_reason(trainer) is not None:
        old_routes = old_routing(trainer, batch)  # R2: this forward's experts, replayed by the update's
        old_logp = trainer.run_hooks("old_logp", no_grad_logprobs(trainer, trainer.model, batch, old_routes))
        check_old_logp(trainer, batch, old_logp)
    elif cfg.rollout.routing_replay == "old":  # the update's one forward is the old policy's: nothing to replay
        metrics["rollout/routing_agreement"] = 1.0
    ref_logp = None
    if trainer.uses_reference():
        with reference_model(trainer) as ref:  # a frozen copy, or (LoRA) the model with its adapter disabled
            ref_logp = trainer.run_hooks("ref_logp", no_grad_logprobs(trainer, ref, batch))
        try:
            guard.check("ref_logp", ref_logp, batch.mask)
        except NonFiniteError:
            if old_logp is None:  # the trainer's forward comes later: name its logits if they are the cause
                guard.blame_logits(trainer, batch, ref_logp)
            raise
        if cfg.loss.kl_in_reward:
            rewards, kl_metrics = kl_penalized_rewards(rewards.to(trainer.device), old_logp, ref_logp, batch.mask,
                                                       trainer.loss_config().kl_coef)
            rewards = rewards.cpu()
            metrics.update({k: float(v) for k, v in kl_metrics.items()})
    # Advantages see every sample of every group on every rank: gather the rewards.
    rewards = pdist.all_gather_cat(trainer.dist, rewards)
    if getattr(trainer, "sp", None) is not None:  # a sequence-parallel group's ranks hold the same rows: its first's
        rewards = rewards.view(trainer.dist.world_size, -1)[:: trainer.sp.size].reshape(-1)
    guard.sync()
    metrics["reward/mean"] = float(rewards.mean())
    metrics["reward/std"] = float(rewards.std()) if rewards.numel() > 1 else 0.0
    # Dynamic sampling fills a batch short of informative groups with uniform ones: masked out.
    drop = cfg.loss.drop_zero_std_groups or cfg.rollout.dynamic_sampling
    # gae: the group statistics (adv/* metrics, kept groups) only; its advantages are the critic's, below
    estimator = "grpo" if cfg.loss.advantage_estimator == "gae" else cfg.loss.advantage_estimator
    adv = compute_advantages(rewards, g, estimator, drop_zero_std=drop, **cfg.loss.advantage_options())
    metrics.update({f"adv/{k}": float(v) for k, v in adv.metrics.items()})
    mine = slice(phase.offset * g, (phase.offset + len(examples)) * g)
    advantages = trainer.run_hooks("advantage", adv.advantages[mine].to(trainer.device))
    check_finite("advantage", advantages)
    trainer.last_samples["advantages"] = advantages.cpu().tolist()
    values = returns = None
    if cfg.loss.advantage_estimator == "gae":  # PPO: per-token advantages from the value model (phases/critic.py)
        from portarl.trainer.phases.token_advantages import gae_advantages

        advantages, values, returns = gae_advantages(trainer, batch, rewards[mine], metrics)
    if cfg.loss.distill is not None:  # on-policy distillation: the teacher's reverse KL per token (phases/distill.py)
        from portarl.trainer.phases.distill import distill_advantages

        teacher_logp = no_grad_logprobs(trainer, trainer.teacher, batch)
        advantages = distill_advantages(trainer, batch, advantages, old_logp, rollout_logp, teacher_logp, metrics)
    # Dropped groups (DAPO dynamic sampling) are masked out, not removed, so every rank
    # runs the same number of micro-batches (FSDP forwards are collective).
    keep = adv.keep[mine].to(trainer.device)
    finished = truncated_keep(cfg, rollout.finished, trainer.device, metrics)  # TRL's mask_truncated_completions
    if finished is not None:
        keep = keep & finished
    batch = dataclasses.replace(batch, mask=batch.mask & keep[:, None])
    if old_routes is not None:  # R2: after the reference's forward, which routes by its own router
        batch = dataclasses.replace(batch, routing=old_routes)
    return Scored(batch, old_logp, ref_logp, rollout_logp, advantages, values, returns)
