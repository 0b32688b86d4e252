"""The GRPO run loop: one :meth:`GRPOTrainer.train_step` after another, with logging,
the sample log, checkpoints on cadence, and every way a run ends early (a guard's stop, a
streak of skipped steps, user code that fails, exits or hangs, a signal) saving what it
can first."""

from __future__ import annotations

from pathlib import Path

from portarl.runtime import blackbox
from portarl.assets.reward_runner import RewardError
from portarl.trainer.asynchronous.pipeline import RolloutWorkerError
from portarl.trainer.run.samples import SampleLog, exact_text
from portarl.trainer.start.setup import forced_backend
from portarl.trainer.run.signals import StopRequested
from portarl.trainer.guards.step_guard import UpdateUnrecoverable
from portarl.runtime.user_code import UserCodeError


class TrainingStopped(RuntimeError):
    """The run stopped itself (persistent non-finite values); a checkpoint was saved."""

    def __init__(self, message: str, tensor_name: str, checkpoint: Path | None):
        super().__init__(message)
        self.tensor_name = tensor_name
        self.checkpoint = checkpoint


def run_loop(trainer, logger, last_ckpt: Path | None) -> Path | None:
    """Steps until ``train.steps``: each logged, sampled, checked by the stop rules (guard
    stops, skip streaks, reward errors, signals agreed by every rank) and checkpointed on
    cadence. Returns the last checkpoint; raises :class:`TrainingStopped` or
    :class:`~portarl.trainer.run.signals.StopRequested`."""
    cfg = trainer.config
    if not trainer.sft_done:
        trainer.warmup_sft(logger)
        trainer.ref_model = trainer.make_reference() if trainer.uses_reference() else None
    elif trainer.uses_reference() and trainer.ref_model is None:
        trainer.ref_model = trainer.make_reference()
    samples = SampleLog(trainer.output_dir, cfg.logging.samples_every, cfg.logging.samples_count,
                        getattr(logger, "writer", None), decode=exact_text(trainer.codec.tokenizer),
                        trackers=getattr(logger, "trackers", None)) \
        if trainer.dist.is_main else None
    while trainer.step < cfg.train.steps:
        with forced_backend(cfg.precision.backend):
            optimizer_steps = trainer.scheduler.last_epoch
            try:
                metrics = trainer.train_step()
            except UpdateUnrecoverable as err:  # guards.update_snapshot=false: nothing to restore from
                message = f"stopping at step {trainer.step + 1}: {err}. Last good checkpoint: {trainer.checkpoints.latest()}"
                logger.event(trainer.step + 1, "stopped", message)
                raise TrainingStopped(message, "optimizer_update", trainer.checkpoints.latest()) from None
            except UserCodeError as err:  # a reward or hook raised, exited, hung, or a stop signal ended it
                raise stop_on_user_code(trainer, logger, err, trainer.scheduler.last_epoch != optimizer_steps) from err
            except RolloutWorkerError as err:  # rollout.mode=async: nothing of this step was applied either
                last_ckpt = trainer.save_checkpoint()
                message = f"stopping at step {trainer.step + 1}: {err}. Checkpoint of step {trainer.step}: {last_ckpt}"
                logger.event(trainer.step + 1, "stopped", message)
                raise TrainingStopped(message, "rollout_worker", last_ckpt) from None
        events = metrics.pop("_events")
        if trainer.evaluator is not None and trainer.evaluator.due(trainer.step):  # eval.data: eval/* metrics
            blackbox.note(phase="eval")
            metrics.update(trainer.evaluator.run(trainer))
            if (note := trainer.evaluator.keep_best(trainer, metrics)) is not None:
                events.append(("best_checkpoint", note, {}))
        logger.step(metrics)
        if samples is not None and samples.due(trainer.step) and trainer.last_samples is not None:
            samples.write(trainer.step, trainer.last_samples)
        for kind, message, fields in events:
            logger.event(trainer.step, kind, message, **{k: v for k, v in fields.items() if k != "kind"})
        if trainer.stop_reason is not None:  # a guard with action "stop"
            last_ckpt = stop_with_checkpoint(trainer, logger, f"stopping at step {trainer.step}: {trainer.stop_reason} "
                                            f"(guards.spike_action=stop); that optimizer step was not applied",
                                   trainer.stop_reason)
        if trainer.consecutive_skips >= cfg.guards.max_consecutive_skips:
            stop_with_checkpoint(trainer, logger, f"stopping at step {trainer.step}: {trainer.consecutive_skips} steps in "
                                 f"a row skipped; the first non-finite tensor was {trainer.streak_first_bad}",
                                 trainer.streak_first_bad)
        if trainer.step % cfg.checkpoint.every == 0 or trainer.step == cfg.train.steps:
            last_ckpt = trainer.save_checkpoint()
            if trainer.refused_checkpoint:
                logger.event(trainer.step, "checkpoint_refused", trainer.refused_checkpoint)
        if trainer.stop_requested_anywhere():
            if trainer.checkpoints.latest() != trainer.checkpoints.root / f"step-{trainer.step:06d}":
                last_ckpt = trainer.save_checkpoint()
            logger.event(trainer.step, "interrupted", f"stopped on request after step {trainer.step}; checkpoint {last_ckpt}")
            raise StopRequested(trainer.stop_signal, trainer.step, last_ckpt)
    return last_ckpt


def stop_on_user_code(trainer, logger, err: UserCodeError, applied: bool) -> TrainingStopped | StopRequested:
    """What ends the run when user code failed in step ``trainer.step + 1``. A reward runs
    before any optimizer step, so nothing of the step was applied and the checkpoint saved
    now is the last finished step's; a hook that fails after an optimizer step of the
    iteration (``applied``) leaves weights that belong to no step: nothing is saved, and
    the last checkpoint is named. A stop signal that ended the call (any rank's) makes it
    the signal's stop (:class:`StopRequested`, exit 128 + signal), otherwise
    :class:`TrainingStopped` (exit 3)."""
    step = trainer.step + 1
    if applied:
        last_ckpt = trainer.checkpoints.latest()
        saved = f"step {step} was partly applied, so it is not saved; last checkpoint: {last_ckpt}"
    else:
        last_ckpt = trainer.save_checkpoint()
        saved = f"Checkpoint of step {trainer.step}: {last_ckpt}"
    if trainer.stop_requested_anywhere():
        logger.event(trainer.step, "interrupted", f"stopped on request during step {step} ({err}); {saved}")
        return StopRequested(trainer.stop_signal, trainer.step, last_ckpt)
    message = f"stopping at step {step}: {err}. {saved}"
    logger.event(step, "stopped", message)
    return TrainingStopped(message, "reward" if isinstance(err, RewardError) else "user_code", last_ckpt)


def stop_with_checkpoint(trainer, logger, message: str, tensor_name: str | None):
    """Save a checkpoint (refused when the weights are not finite), log, raise TrainingStopped."""
    trainer.refused_checkpoint = None
    ckpt = trainer.save_checkpoint()
    if trainer.refused_checkpoint:
        message += f". No checkpoint written: {trainer.refused_checkpoint}"
        logger.event(trainer.step, "checkpoint_refused", trainer.refused_checkpoint)
    else:
        message += f". Checkpoint: {ckpt}"
    logger.event(trainer.step, "stopped", message)
    raise TrainingStopped(message, tensor_name or "unknown", ckpt)


__all__ = ["TrainingStopped", "run_loop", "stop_on_user_code", "stop_with_checkpoint"]
