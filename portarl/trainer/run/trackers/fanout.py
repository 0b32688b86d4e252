"""The trackers of one run, started together and fed together, with one failure policy.

Why the policy is "one warning, then without it": a tracker's own client already retries
what can be retried (W&B and SwanLab queue and upload in the background, MLflow's HTTP client
retries with back-off before it raises), so an exception that reaches portarl means the
tracker is gone for now (no network, a quota, a revoked key). Retrying it every step would
repeat the client's own waits each step and the warning each step; stopping the run would
lose training for a dashboard. ``metrics.jsonl`` holds every step either way, so the warning
names it. A tracker that cannot start is the same: one warning at the start.

Under torchrun only rank 0 makes a :class:`Trackers` (:mod:`portarl.trainer.run.session`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from portarl.trainer.run.trackers.common import RunInfo, flat_config, setting  # noqa: F401  (public here too)

log = logging.getLogger("portarl.train")

#: The columns of the sample table every tracker gets, before one column per reward
#: function (``reward/<name>``): the fields of a ``samples.jsonl`` row a person reads.
SAMPLE_COLUMNS = ("step", "sample", "prompt", "completion", "reward", "advantage", "finish_reason")


def numbers(metrics: dict) -> dict[str, float]:
    """The finite numbers of a ``metrics.jsonl`` row, ``step`` left out (it is the x axis).
    Strings (``phase``) and non-finite values are left out too: ``metrics.jsonl`` keeps
    those (as ``"nan"``), and a skipped step is an event (events.jsonl) of its own."""
    out = {}
    for key, value in metrics.items():
        if key == "step" or isinstance(value, str) or not isinstance(value, (int, float)):
            continue
        value = float(value)
        if math.isfinite(value):
            out[key] = value
    return out


def sample_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """``(columns, data)`` of ``samples.jsonl`` rows: :data:`SAMPLE_COLUMNS` and a column per
    reward function. Text is kept whole; a value that is not finite is already null in the
    rows (:mod:`portarl.trainer.run.samples`)."""
    rewards = sorted({name for row in rows for name in row.get("rewards", {})})
    columns = [*SAMPLE_COLUMNS, *(f"reward/{name}" for name in rewards)]
    data = [[row.get(c) for c in SAMPLE_COLUMNS] + [row.get("rewards", {}).get(name) for name in rewards]
            for row in rows]
    return columns, data


def _tracker_class(name: str):
    if name == "wandb":
        from portarl.trainer.run.trackers.wandb_tracker import WandbTracker as cls
    elif name == "swanlab":
        from portarl.trainer.run.trackers.swanlab_tracker import SwanlabTracker as cls
    elif name == "mlflow":
        from portarl.trainer.run.trackers.mlflow_tracker import MlflowTracker as cls
    elif name == "trackio":
        from portarl.trainer.run.trackers.trackio_tracker import TrackioTracker as cls
    else:
        raise ValueError(f"unknown tracker {name!r}")
    return cls


class Trackers:
    """The started trackers of a run (TensorBoard aside: the logger's own writer)."""

    def __init__(self, started: list | None = None):
        self.live = list(started or [])
        #: tracker -> run id, of every tracker that started (one that fails later keeps its
        #: id: a --resume continues its run once it works again)
        self.ids = {t.name: t.run_id for t in self.live}

    @classmethod
    def start(cls, names, sections: dict, run: RunInfo, resume_ids: dict | None = None) -> "Trackers":
        """Start each tracker of ``names`` (``sections``: name -> its settings section),
        continuing the run of ``resume_ids[name]`` where given. A tracker that fails to start
        is one warning; the others start."""
        started = []
        try:
            for name in names:
                resume_id = (resume_ids or {}).get(name)
                try:
                    started.append(_tracker_class(name)(sections[name], run=run, resume_id=resume_id))
                except Exception as err:  # noqa: BLE001 (any failure of a third-party client: the policy above)
                    log.warning("%s: could not start (%s); this run goes on without %s (metrics.jsonl has every step)",
                                name, _one_line(err), name)
        except BaseException:  # Ctrl-C while one starts: those already started are finished, not left running
            cls(started).close("interrupted")
            raise
        return cls(started)

    def metrics(self, metrics: dict) -> None:
        values, step = numbers(metrics), int(metrics["step"])
        if values:
            self._each("logging step %d" % step, lambda t: t.metrics(step, values))

    def samples(self, step: int, rows: list[dict]) -> None:
        if rows:
            columns, data = sample_table(rows)
            self._each("logging the samples of step %d" % step, lambda t: t.samples(step, columns, data))

    def image(self, step: int, name: str, path: Path) -> None:
        if Path(path).is_file():
            self._each(f"logging {Path(path).name}", lambda t: t.image(step, name, Path(path)))

    def close(self, status: str = "finished") -> None:
        """Finish every tracker's run (``status``: finished, failed or interrupted); each is
        finished even when another fails to."""
        live, self.live = self.live, []
        for tracker in live:
            _finish(tracker, status)

    def _each(self, what: str, call) -> None:
        for tracker in list(self.live):
            try:
                call(tracker)
            except Exception as err:  # noqa: BLE001 (the module docstring's policy)
                self.live.remove(tracker)
                log.warning("%s: %s failed (%s); this run goes on without %s (metrics.jsonl has every step)",
                            tracker.name, what, _one_line(err), tracker.name)
                _finish(tracker, "failed")


def _finish(tracker, status: str) -> None:
    try:
        tracker.finish(status)
    except Exception as err:  # noqa: BLE001
        log.warning("%s: finishing its run failed (%s)", tracker.name, _one_line(err))


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text[:300]}"


__all__ = ["RunInfo", "SAMPLE_COLUMNS", "Trackers", "flat_config", "numbers", "sample_table", "setting"]
