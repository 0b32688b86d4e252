"""One training run of a :class:`portarl.trainer.grpo.GRPOTrainer`, start to end: the
output directory prepared (new, resumed or overwritten: :mod:`portarl.trainer.run.output_dir`),
the global RNGs seeded, the config and logs written by rank 0, the loop run under the
signal handlers and the async pipeline (:func:`portarl.trainer.loop.run_loop`), and the
run's summary. Kept apart from the trainer class, whose file holds the state and one step."""

from __future__ import annotations

from pathlib import Path

from portarl.trainer.asynchronous.pipeline import async_rollout
from portarl.trainer.checkpoint import seed_global_rngs
from portarl.trainer.loop import run_loop
from portarl.trainer.phases.linear_head import pick_linear_head
from portarl.trainer.run import output_dir as run_dir
from portarl.trainer.run import persistence
from portarl.trainer.run.logger import RunLogger, finish_run
from portarl.trainer.run.signals import graceful_stop
from portarl.trainer.run.write_failure import writing
from portarl.trainer.setup import SilentLogger


def train_run(trainer, resume: bool, overwrite: bool, start_if_none: bool) -> tuple[int, Path | None, str]:
    """Train ``trainer`` to ``train.steps`` (:meth:`GRPOTrainer.train` holds the directory's
    lock around it); returns ``(last step, last checkpoint, summary)`` (the summary only
    on rank 0)."""
    cfg = trainer.config
    changes = run_dir.prepare_run(trainer, resume=resume, overwrite=overwrite)
    seed_global_rngs(cfg.train.seed)  # user code's randomness; a checkpoint's states replace it on resume
    if resume:
        persistence.resume(trainer, start_if_none)
        run_dir.check_steps_ahead(trainer.step, cfg.train.steps, trainer.output_dir)
        run_dir.apply_resumed_changes(trainer, changes)
    else:
        trainer.checkpoints.clean_partial()
    if trainer.dist.is_main:
        with writing(trainer.output_dir / "config.yaml"):
            cfg.save(trainer.output_dir / "config.yaml")
        logger = RunLogger(trainer.output_dir, total_steps=cfg.train.steps, resume_step=trainer.step,
                           tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress)
    else:  # only rank 0 writes logs
        logger = SilentLogger()
    last_ckpt = trainer.checkpoints.latest()
    trainer.stop_requested, trainer.stop_signal = False, None
    head = pick_linear_head(trainer)  # on a GPU: timed now, not inside the first step
    if head is not None:
        logger.event(trainer.step, "linear_head", head)
    if not cfg.precision.use_master and cfg.precision.dtype != "fp32":
        logger.event(trainer.step, "precision_warning", f"precision.master_weights_fp32=false with {cfg.precision.dtype}: "
                     "updates below the weights' resolution are lost (update/lost_frac)")
    try:
        with graceful_stop(trainer), async_rollout(trainer):  # signals: finish the step, save, stop
            last_ckpt = run_loop(trainer, logger, last_ckpt)
    finally:
        logger.close()
        if trainer.agent is not None:  # tool_isolation=process: its child, stopped and joined
            trainer.agent.close()
    if not trainer.dist.is_main:
        return trainer.step, last_ckpt, ""
    return trainer.step, last_ckpt, finish_run(trainer.output_dir, cfg.logging.plot)
