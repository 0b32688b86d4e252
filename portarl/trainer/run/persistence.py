"""A GRPO run's checkpoints: what is saved beside the weights, writing one (refused while
the weights are not finite), and resuming from the newest one that verifies.

The trainer calls these through :meth:`GRPOTrainer.save_checkpoint` and
:meth:`GRPOTrainer.resume`; the file formats are :mod:`portarl.trainer.checkpoint`'s
(safetensors + JSON with a sha256 manifest; DCP shards under torchrun), never pickle.
"""

from __future__ import annotations

import logging
from pathlib import Path

from portarl.runtime import distributed as pdist
from portarl.trainer.asynchronous.resume import STATE_KEY, in_flight_state
from portarl.trainer.checkpoint import CheckpointError, rng_state, set_rng_state
from portarl.trainer.checkpoint import step_of as state_step
from portarl.trainer.run.output_dir import no_checkpoint
from portarl.trainer.start.setup import make_precision
from portarl.trainer.guards.step_guard import checkpoint_refusal

log = logging.getLogger("portarl.train")


def trainer_state(trainer) -> dict:
    """Everything but the weights that a resumed run needs, as the checkpoint stores it
    (JSON + safetensors through :mod:`portarl.trainer.checkpoint.safe_state`)."""
    return {
        "step": trainer.step,
        "sft_done": trainer.sft_done,
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "precision": trainer.precision.state_dict(),
        "rng": rng_state(),
        "kl_spikes": trainer.kl_spikes.state_dict(),
        "grad_spikes": trainer.grad_spikes.state_dict(),
        "degenerate": trainer.degenerate.state_dict(),
        "skipped_total": trainer.skipped_total,
        "consecutive_skips": trainer.consecutive_skips,
        "streak_first_bad": trainer.streak_first_bad,
        "kl_ctl": trainer.kl_ctl.state_dict(),
        "ref_model": {k: v.detach().cpu() for k, v in trainer.ref_model.state_dict().items()} if trainer.ref_model is not None else None,
        "config": trainer.config.to_dict(),
        # the config file's directory (not a config field): `portarl eval` looks for the run's
        # module:function rewards and tools there too
        "source_dir": getattr(trainer.config, "source_dir", None),
        # logging.trackers: each tracker's run id (rank 0 writes the state), so --resume continues that run
        "trackers": dict(trainer.tracker_runs),
        # loss.advantage_estimator=gae: the value model's weights and optimizer (phases/critic.py)
        "critic": trainer.critic.state() if trainer.critic is not None else None,
        # rollout.mode=async: the batches already generated for the next steps (waited for)
        STATE_KEY: in_flight_state(trainer.async_rollout) if trainer.async_rollout is not None else None,
    }

def save_checkpoint(trainer) -> Path | None:
    """Write a checkpoint of this step; refuse (log an error, return the last good one)
    when a weight or fp32 master is not finite: a checkpoint is what a run resumes
    from, and a corrupted one would hide the failure behind a restart."""
    trainer.refused_checkpoint = checkpoint_refusal(trainer)
    if trainer.refused_checkpoint is not None:
        return trainer.checkpoints.latest()
    if trainer.dist.enabled:
        state = trainer_state(trainer)
        state.pop("optimizer")  # in the DCP shards
        state["ref_model"] = None  # the reference is the initial model: rebuilt from model.path
        path = trainer.checkpoints.save_sharded(trainer.step, trainer.model, trainer.optimizer, trainer.tokenizer, state, trainer.dist)
        if trainer.dist.is_main:
            log.info("checkpoint saved (DCP, %d ranks): %s", trainer.dist.world_size, path)
        return path
    path = trainer.checkpoints.save(trainer.step, trainer.model, trainer.tokenizer, trainer_state(trainer))
    log.info("checkpoint saved: %s", path)
    return path

def _weights_loader(trainer):
    """Loads a verified checkpoint's weights (and, sharded, the optimizer) into the trainer;
    a read error skips the checkpoint (:meth:`CheckpointManager.load_newest_verified`), and
    the next one's weights replace whatever was partly loaded."""

    def load(directory: Path, state: dict) -> None:
        if trainer.checkpoints.is_sharded(directory):
            trainer.checkpoints.load_sharded(directory, trainer.model, trainer.optimizer, verify=False)  # just verified
            state["optimizer"] = trainer.optimizer.state_dict()
        else:
            trainer.checkpoints.load_weights(trainer.model, directory, verify=False)

    return load


def resume(trainer, start_if_none: bool = False) -> int:
    """Load the latest complete checkpoint; returns its step. None there: a
    :class:`~portarl.trainer.run.output_dir.RunDirError`, or step 0 with ``start_if_none``."""
    if trainer.dist.enabled:
        pdist.barrier(trainer.dist)
    for removed in (trainer.checkpoints.clean_partial() if trainer.dist.is_main else []):
        log.warning("removed an incomplete checkpoint left by an interrupted write: %s", removed)
    # Newest checkpoint that verifies against its manifest and whose every file reads
    # (damaged ones are skipped, named and moved aside by rank 0); every rank must pick the same one.
    found = trainer.checkpoints.load_newest_verified(quarantine=trainer.dist.is_main, load=_weights_loader(trainer))
    if trainer.dist.enabled:
        chosen = -1 if found is None else state_step(found[0])
        if pdist.first_code(trainer.dist, chosen) != -pdist.first_code(trainer.dist, -chosen):
            raise CheckpointError(f"ranks chose different checkpoints to resume from in {trainer.checkpoints.root} "
                                  f"(rank {trainer.dist.rank}: step {chosen}); is the directory shared by every rank?")
    if found is None:
        if not start_if_none:
            raise no_checkpoint(trainer.output_dir)
        log.info("no checkpoint in %s: starting a new run (--resume-or-start)", trainer.checkpoints.root)
        return 0
    latest, state = found
    trainer.precision = make_precision(trainer.model, trainer.config, trainer.dist)
    trainer.precision.load_state_dict(state["precision"])
    if trainer.precision.use_master:
        trainer.optimizer.param_groups[0]["params"] = trainer.precision.optimizer_params()
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    trainer.kl_spikes.load_state_dict(state["kl_spikes"])
    trainer.grad_spikes.load_state_dict(state["grad_spikes"])
    trainer.degenerate.load_state_dict(state["degenerate"])
    trainer.step, trainer.sft_done = state["step"], state["sft_done"]
    trainer.skipped_total, trainer.consecutive_skips = state["skipped_total"], state["consecutive_skips"]
    trainer.streak_first_bad = state["streak_first_bad"]
    trainer.tracker_runs = dict(state.get("trackers") or {})  # absent in checkpoints written before trackers
    trainer.async_in_flight = state.get(STATE_KEY)  # absent in checkpoints written before it; read by the pipeline
    if state.get("kl_ctl") is not None:  # absent in checkpoints written before the KL controller
        trainer.kl_ctl.load_state_dict(state["kl_ctl"])
    if trainer.critic is not None:
        if state.get("critic") is None:
            raise CheckpointError(f"checkpoint {latest} holds no value model, but loss.advantage_estimator=gae needs "
                                  "one: resume with the estimator the run started with")
        trainer.critic.load(state["critic"])
    if state["ref_model"] is not None and not trainer.dist.enabled:
        trainer.ref_model = trainer.make_reference()
        trainer.ref_model.load_state_dict(state["ref_model"])
    log.info("resumed from %s (step %d)", latest, trainer.step)
    return trainer.step


__all__ = ["resume", "save_checkpoint", "trainer_state"]
