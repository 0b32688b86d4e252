"""One GRPO iteration, phase after phase: the body of :meth:`GRPOTrainer.train_step`.

:func:`portarl.trainer.phases.rollout.run_rollout`, :func:`portarl.trainer.phases.scoring.score`,
then :func:`portarl.trainer.phases.update.run_update` (or, during ``critic.warmup_steps``, no
policy update at all) and the value model's update; the guards
(:mod:`portarl.trainer.guards.step_guard`) run through all of them. Under torchrun the metrics
are averaged over ranks before the KL controller moves, so every rank moves it alike. The phase
functions are looked up in this module's namespace at call time (benchmarks and tests wrap
them here)."""

from __future__ import annotations

import time

from portarl.runtime import blackbox
from portarl.runtime import distributed as pdist
from portarl.trainer.guards.detectors import GuardTripped
from portarl.trainer.guards.step_guard import finish_metrics, record_bad, record_clean, record_skip
from portarl.trainer.memory.heap import release_freed_memory
from portarl.trainer.phases.critic import critic_update
from portarl.trainer.phases.reference import maybe_sync_reference
from portarl.trainer.phases.rollout import run_rollout
from portarl.trainer.phases.scoring import score
from portarl.trainer.phases.update import run_update

__all__ = ["run_iteration"]


def run_iteration(trainer) -> dict:
    """Run iteration ``trainer.step + 1`` and return its metrics (``skipped`` = 1 when skipped)."""
    step = trainer.step + 1
    trainer.hook_step = step
    blackbox.note(step=step, phase="rollout")  # what a supervisor names if the process dies
    started, cpu_started = time.perf_counter(), time.process_time()
    phase = run_rollout(trainer, step)
    release_freed_memory()  # the rollout's caches, before scoring and the update allocate
    metrics, events = phase.metrics, phase.events
    skipped, overflow = False, False
    trainer.guard.reset()
    trainer.partial_update = None
    trainer.last_samples = None
    try:
        blackbox.note(phase="scoring")
        scored = score(trainer, phase, metrics)
        release_freed_memory()
        blackbox.note(phase="update")
        if trainer.critic is not None and step <= trainer.config.critic.warmup_steps:  # value-only: the policy stays
            metrics.update({"critic/warmup": 1.0, "grad_norm": 0.0, "loss": 0.0, "kl/value": 0.0,
                            "update/applied_steps": 0})
        else:
            overflow = run_update(trainer, scored, metrics, events)
        if trainer.critic is not None:
            critic_update(trainer, scored, metrics)
    except GuardTripped as err:
        skipped = True
        record_skip(trainer, err, metrics, events)
    else:
        if trainer.partial_update is not None:
            record_bad(trainer, trainer.partial_update)
        else:
            record_clean(trainer)
    finish_metrics(trainer, metrics, events, skipped, overflow)
    if trainer.config.rollout.routing_replay != "off":  # MoE: how often the trainer would have routed as recorded
        from portarl.moe.routing import take_agreement

        agree, counted = take_agreement(trainer.model)
        if counted:
            metrics["rollout/routing_agreement"] = agree / counted
    metrics["time/step_s"] = time.perf_counter() - started
    metrics["time/step_cpu_s"] = time.process_time() - cpu_started  # this process's threads (bench async)
    sp = getattr(trainer, "sp", None)
    groups = trainer.dist.world_size // (sp.size if sp is not None else 1)  # data-parallel groups
    if trainer.dist.enabled:
        for key in [k for k in metrics if k == "loss" or k.endswith("/loss")]:
            metrics[key] = metrics[key] * groups  # shares: the mean of groups x share is the sum
        metrics = pdist.mean_metrics(trainer.dist, metrics)
    if not skipped:  # after the rank mean: every rank moves its coefficient by the same global KL
        trainer.kl_ctl.update(metrics["kl"], len(phase.rollout.completion_ids) * groups)
        maybe_sync_reference(trainer, step, metrics)
    metrics["kl/coef"] = trainer.kl_ctl.value
    metrics["_events"] = events
    trainer.step = step
    return metrics
