"""One run per output directory, and what ``--resume`` may change.

Why this exists: a second run started into a directory that already holds a run used to
mix the two silently. The old checkpoints stayed, ``keep_last`` pruned the *new* run's
checkpoints (the old step numbers were higher), ``metrics.jsonl`` was overwritten, and a
later ``--resume`` continued the old run. So a fresh run into a directory holding another
run's checkpoints or metrics is refused, naming ``--resume`` and ``--overwrite``.

``--overwrite`` removes only what a run writes (:data:`RUN_FILES`): pointing it at a
directory with other files in it by mistake must not delete those.

On ``--resume`` the saved ``config.yaml`` is compared with the new config. The settings
that can change mid-run without making the checkpoint mean something else
(:data:`MID_RUN_FIELDS`: steps, learning rate, logging, checkpoint cadence, device, and
how old log-probs and the AdamW update are computed, which change no result) are
applied and reported; any other difference is refused with the field names, because the
checkpoint's weights and optimizer state were made under the old values (a changed
``model.hidden_size`` would otherwise end in a raw ``load_state_dict`` traceback, and a
changed ``optim.lr`` used to be recorded in ``config.yaml`` but never used).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from portarl.runtime.continuation import existing_run as _existing_run

log = logging.getLogger("portarl.train")

#: What a training run writes into its output directory (all of it, and only it, is
#: removed by ``--overwrite``).
RUN_FILES = ("checkpoints", "metrics.jsonl", "events.jsonl", "samples.jsonl", "tensorboard", "config.yaml", "summary.txt",
             "curves.png", "best", "rollout_batches.jsonl", "rollout_worker.log", "async_weights",  # these three: async mode
             "crash.log",  # portarl/runtime/supervisor.py
             "wandb", "swanlog")  # logging.trackers' own files where their settings leave them (docs/trackers.md)

#: Fields (``section.field``; a trailing dot: the whole section) that ``--resume`` applies.
MID_RUN_FIELDS = ("train.steps", "train.old_logprobs", "optim.lr", "optim.implementation", "logging.",
                  "checkpoint.every", "checkpoint.keep_last", "device", "eval.", "rollout.timeout_s",
                  "train.reward_timeout_s", "distributed.timeout_s",
                  # detector settings only: they never change what the run computes
                  "rollout.identical_warn_frac", "rollout.identical_min_chance")

#: Never compared: the directory is where the saved config was found; a retired field
#: (config_fields.RETIRED_FIELDS) is in configs saved by earlier versions only.
_IGNORED = ("output_dir", "rollout.collapse_entropy")


class RunDirError(ValueError):
    """The output directory cannot be used as asked; the message says what to do instead."""


def check_output_dir(output_dir: str | Path, *, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse an output directory that is a file, or that holds another run when neither
    ``resume`` nor ``overwrite`` is set. Changes nothing on disk."""
    directory = Path(output_dir)
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other: --resume continues the run in "
                          f"{directory}, --overwrite deletes it")
    if directory.exists() and not directory.is_dir():
        raise RunDirError(f"output directory {directory} is a file, not a directory: choose another --output-dir")
    if resume or overwrite or not directory.is_dir():
        return
    existing = _existing_run(directory)
    if existing:
        raise RunDirError(f"output directory {directory} already holds a run ({existing}): pass --resume to "
                          "continue it, --overwrite to delete it and start over, or choose another --output-dir")


def create_output_dir(output_dir: str | Path) -> Path:
    """Create ``output_dir`` (and its parents) now, before anything is built: a directory
    that cannot be created (``/sys/x``, a path under a file, no permission) is one line,
    not a traceback from the trainer."""
    directory = Path(output_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(directory) else ""
        raise RunDirError(f"cannot create the output directory {directory}: {err.strerror or err}{where}; choose "
                          "another --output-dir") from None
    return directory


def clear_run(output_dir: str | Path) -> list[Path]:
    """Remove what a run wrote (:data:`RUN_FILES`) from ``output_dir``; returns what was removed."""
    directory = Path(output_dir)
    removed = []
    for name in RUN_FILES:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(path)
    return removed


def _flatten(values, prefix: str = "") -> dict:
    if isinstance(values, dict):
        out = {}
        for key, value in values.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: values}


def _mid_run(field: str) -> bool:
    return any(field == f or (f.endswith(".") and field.startswith(f)) for f in MID_RUN_FIELDS)


def config_changes(saved: dict, new: dict) -> tuple[list[tuple[str, object, object]], list[tuple[str, object, object]]]:
    """``(applicable, refused)``: the fields whose values differ between two config dicts
    (``TrainConfig.to_dict()`` shape), each as ``(field, old, new)``, split by
    :data:`MID_RUN_FIELDS`. Lists (``rewards``) compare as a whole."""
    a, b = _flatten(saved), _flatten(new)
    defaults = None
    applicable, refused = [], []
    for field in sorted(set(a) | set(b)):
        if field in _IGNORED:
            continue
        old, now = a.get(field, "<absent>"), b.get(field, "<absent>")
        if old == now:
            continue
        if old == "<absent>":  # a field added after the run started: no change when it holds its default
            if defaults is None:
                from portarl.trainer.config import TrainConfig

                defaults = _flatten(_as_saved(TrainConfig()))
            if defaults.get(field, "<absent>") == now:
                continue
        (applicable if _mid_run(field) else refused).append((field, old, now))
    return applicable, refused


def _as_saved(config) -> dict:
    """The new config as ``config.yaml`` would hold it, so types compare like for like."""
    import yaml

    return yaml.safe_load(yaml.safe_dump(config.to_dict(), sort_keys=False))


def check_resume_config(output_dir: str | Path, config) -> list[tuple[str, object, object]]:
    """Compare ``output_dir/config.yaml`` with ``config`` for ``--resume``. Returns the
    mid-run changes to apply; raises :class:`RunDirError` naming every other change."""
    import yaml

    path = Path(output_dir) / "config.yaml"
    if not path.is_file():
        return []
    try:
        saved = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise RunDirError(f"--resume: {path} is not readable YAML ({err.__class__.__name__}); cannot tell "
                          "whether the settings changed") from None
    applicable, refused = config_changes(saved, _as_saved(config))
    if refused:
        listed = "; ".join(f"{f}: {old!r} -> {new!r}" for f, old, new in refused)
        raise RunDirError(
            f"--resume: these settings differ from the run in {output_dir} and cannot change mid-run: {listed}. "
            f"Only {', '.join(f.rstrip('.') + ('*' if f.endswith('.') else '') for f in MID_RUN_FIELDS)} can; "
            "drop the other changes, or start a new run (another --output-dir, or --overwrite)"
        )
    return applicable


def describe_changes(changes: list[tuple[str, object, object]]) -> str:
    return ", ".join(f"{f} {old!r} -> {new!r}" for f, old, new in changes)


def apply_learning_rate(optimizer, scheduler, lr: float) -> None:
    """Make a resumed optimizer use ``lr``. Loading the optimizer and LambdaLR state puts the
    saved base learning rate back, so a changed ``optim.lr`` has to be set after the load:
    the base rate, and the current rate at the schedule's position."""
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    position = scheduler.last_epoch
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(position)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def prepare_run(trainer, *, resume: bool, overwrite: bool) -> list[tuple[str, object, object]]:
    """What :meth:`GRPOTrainer.train` does first: refuse a directory holding another run,
    clear it for ``overwrite``, and for ``resume`` check the config (returns the changes to
    apply after the checkpoint is loaded, see :func:`apply_resumed_changes`)."""
    directory = trainer.output_dir
    check_output_dir(directory, resume=resume, overwrite=overwrite)
    if overwrite:
        if trainer.dist.is_main:
            removed = clear_run(directory)
            if removed:
                log.info("--overwrite: removed the previous run's %s from %s", ", ".join(p.name for p in removed), directory)
        if trainer.dist.enabled:
            from portarl.runtime import distributed as pdist

            pdist.barrier(trainer.dist)
        return []
    if resume:
        return check_resume_config(directory, trainer.config)
    return []


def no_checkpoint(output_dir) -> RunDirError:
    """``--resume`` where there is no checkpoint: a mistyped --output-dir must not silently
    start a new run from scratch."""
    # On several nodes the likely cause: this node's --output-dir is its own disk, not the shared one.
    nodes = ("; a job on several nodes needs an --output-dir that every node shares (the same path on a shared "
             "filesystem)" if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 else "")
    return RunDirError(f"--resume: no checkpoint in {Path(output_dir) / 'checkpoints'} to continue from (is --output-dir "
                       "right?): start a new run without --resume, or pass --resume-or-start to continue when there is "
                       f"a checkpoint and start a new run when there is none{nodes}")


def check_steps_ahead(done: int, steps: int, output_dir) -> None:
    """``--resume`` with ``train.steps`` below the steps already done would end at once and
    record the smaller number in config.yaml: refused, with both numbers."""
    if steps < done:
        raise RunDirError(f"--resume: train.steps={steps} but the run in {output_dir} has already done {done} steps; "
                          f"pass train.steps >= {done} (e.g. --steps {done + 100}), or start a new run (another "
                          "--output-dir, or --overwrite)")


def apply_resumed_changes(trainer, changes: list[tuple[str, object, object]]) -> None:
    """Apply the mid-run changes after the checkpoint is loaded and say which. Only the
    learning rate lives in loaded state; the other fields are read from the config as the
    run goes (steps, logging, checkpoint cadence, device)."""
    if not changes:
        return
    if any(field == "optim.lr" for field, _, _ in changes):
        apply_learning_rate(trainer.optimizer, trainer.scheduler, trainer.config.optim.lr)
    log.info("--resume: applied changed settings: %s", describe_changes(changes))
