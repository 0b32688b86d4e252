"""One training run of a :class:`portarl.trainer.grpo.GRPOTrainer`, start to end: the
output directory prepared (new, resumed or overwritten: :mod:`portarl.trainer.run.output_dir`),
the global RNGs seeded, the config and logs written by rank 0 (and its experiment trackers
started, :mod:`portarl.trainer.run.trackers`, and finished on every way out), the loop run
under the signal handlers and the async pipeline (:func:`portarl.trainer.loop.run_loop`), and
the run's summary. Kept apart from the trainer class, whose file holds the state and one step."""

from __future__ import annotations

from pathlib import Path

from portarl.trainer.asynchronous.pipeline import async_rollout
from portarl.trainer.checkpoint import seed_global_rngs
from portarl.trainer.loop import run_loop
from portarl.trainer.phases.linear_head import pick_linear_head
from portarl.trainer.run import output_dir as run_dir
from portarl.trainer.run import persistence
from portarl.trainer.run.logger import RunLogger, finish_run
from portarl.trainer.run.signals import StopRequested, graceful_stop
from portarl.trainer.run.trackers import check_installed
from portarl.trainer.run.trackers.fanout import RunInfo, Trackers
from portarl.trainer.run.write_failure import writing
from portarl.trainer.start.setup import SilentLogger


def train_run(trainer, resume: bool, overwrite: bool, start_if_none: bool) -> tuple[int, Path | None, str]:
    """Train ``trainer`` to ``train.steps`` (:meth:`GRPOTrainer.train` holds the directory's
    lock around it); returns ``(last step, last checkpoint, summary)`` (the summary only
    on rank 0)."""
    cfg = trainer.config
    check_installed(cfg)  # a tracker's package missing: one line before anything (the CLI checks it earlier still)
    changes = run_dir.prepare_run(trainer, resume=resume, overwrite=overwrite)
    seed_global_rngs(cfg.train.seed)  # user code's randomness; a checkpoint's states replace it on resume
    trainer.tracker_runs = {}  # a new run's trackers start runs of their own; a checkpoint names those to continue
    if resume:
        persistence.resume(trainer, start_if_none)
        run_dir.check_steps_ahead(trainer.step, cfg.train.steps, trainer.output_dir)
        run_dir.apply_resumed_changes(trainer, changes)
    else:
        trainer.checkpoints.clean_partial()
    trackers, outcome = None, "failed"
    try:
        if trainer.dist.is_main:
            with writing(trainer.output_dir / "config.yaml"):
                cfg.save(trainer.output_dir / "config.yaml")
            trackers = start_trackers(trainer)
            logger = RunLogger(trainer.output_dir, total_steps=cfg.train.steps, resume_step=trainer.step,
                               tensorboard="tensorboard" in cfg.logging.active_trackers(),
                               progress=cfg.logging.progress, trackers=trackers)
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
            outcome = "finished"
            return trainer.step, last_ckpt, ""
        summary = finish_run(trainer.output_dir, cfg.logging.plot)
        if trackers is not None and cfg.logging.plot:
            trackers.image(trainer.step, "curves", trainer.output_dir / "curves.png")
        outcome = "finished"
        return trainer.step, last_ckpt, summary
    except (StopRequested, KeyboardInterrupt):
        outcome = "interrupted"
        raise
    finally:
        if trackers is not None:  # each tracker's run finished and its threads / processes stopped
            trackers.close(outcome)


def start_trackers(trainer) -> Trackers:
    """Rank 0's experiment trackers (``logging.trackers`` but TensorBoard, the logger's own),
    continuing the runs the checkpoint names on --resume; their ids are kept on the trainer
    for the next checkpoint (:func:`portarl.trainer.run.persistence.trainer_state`)."""
    cfg = trainer.config
    names = [n for n in cfg.logging.active_trackers() if n != "tensorboard"]
    run = RunInfo(config=cfg.to_dict(), output_dir=Path(trainer.output_dir),
                  default_name=Path(trainer.output_dir).resolve().name, start_step=trainer.step)
    trackers = Trackers.start(names, {n: getattr(cfg.logging, n) for n in names}, run, trainer.tracker_runs)
    trainer.tracker_runs = {**trainer.tracker_runs, **trackers.ids}
    return trackers
