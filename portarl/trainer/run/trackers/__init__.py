"""Experiment trackers beside ``metrics.jsonl``: Weights & Biases, SwanLab, MLflow and
Trackio (TensorBoard is :class:`portarl.trainer.run.logger.RunLogger`'s own writer), chosen by
``logging.trackers`` (:mod:`portarl.trainer.config.trackers`).

Why a fan-out beside the log files rather than instead of them: ``metrics.jsonl`` is the
run's record (resume trims it, the summary and the plot read it); a tracker is a view of it
that a team already watches. So every tracker gets what the file gets, row for row at its
step, and a tracker that fails (its network, its quota) costs one warning and itself, never
the run or the file (:class:`portarl.trainer.run.trackers.fanout.Trackers`).

One module per tracker (``wandb_tracker``, ``swanlab_tracker``, ``mlflow_tracker``,
``trackio_tracker``), each a class with the same five members::

    tracker = WandbTracker(settings, run=RunInfo(...), resume_id=None)  # starts (or continues) its run
    tracker.run_id                     # what the checkpoint keeps, to continue this run on --resume
    tracker.metrics(step, {"reward/mean": 0.3, ...})
    tracker.samples(step, columns, rows)   # the rows samples.jsonl gets, as a table
    tracker.image(step, "curves", path)
    tracker.finish("finished" | "failed" | "interrupted")

This module names each tracker's package and extra, so that a missing one is refused before
the model loads (:func:`missing_extra`).
"""

from __future__ import annotations

import importlib.util

#: tracker -> (the module it imports, the portarl extra that installs it). TensorBoard is not
#: here: the ``train`` extra installs it, and without it the run warns once and goes on (the
#: default tracker must not stop a run that asked for nothing).
PACKAGES = {
    "wandb": ("wandb", "wandb"),
    "swanlab": ("swanlab", "swanlab"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}


def missing_extra(names) -> str | None:
    """One line naming the first tracker of ``names`` whose package is not installed and the
    extra that installs it, or None. Looks the packages up without importing them (an
    import of wandb or mlflow takes seconds)."""
    for name in (n for n in names if n in PACKAGES):
        module, extra = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            return (f"logging.trackers names {name}, but the {module} package is not installed: "
                    f"pip install 'portarl[{extra}]' (or remove {name} from logging.trackers)")
    return None


def swanlab_local_refusal(config) -> str | None:
    """SwanLab's ``local`` mode (``logging.swanlab.mode`` or ``$SWANLAB_MODE``) without its
    dashboard package: SwanLab would log an error and run without the dashboard the mode is
    for. One line naming the install, or None."""
    import os

    if "swanlab" not in config.logging.active_trackers():
        return None
    mode = config.logging.swanlab.mode or os.environ.get("SWANLAB_MODE")
    if mode == "local" and importlib.util.find_spec("swanboard") is None:
        return ("logging.swanlab.mode=local needs SwanLab's dashboard: pip install 'swanlab[dashboard]' (or use "
                "mode offline: files that `swanlab sync` uploads later)")
    return None


def check_installed(config) -> None:
    """Raise :class:`~portarl.trainer.config.ConfigError` (one line) when a tracker of
    ``config.logging`` cannot be imported (or SwanLab's local mode lacks its dashboard)."""
    from portarl.trainer.config import ConfigError

    if (line := missing_extra(config.logging.active_trackers()) or swanlab_local_refusal(config)) is not None:
        raise ConfigError(line)


__all__ = ["PACKAGES", "check_installed", "missing_extra", "swanlab_local_refusal"]
