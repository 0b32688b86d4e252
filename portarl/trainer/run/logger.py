"""Run logging: metrics.jsonl, events.jsonl, TensorBoard and the other experiment trackers
(:mod:`portarl.trainer.run.trackers`), a progress bar, a summary, a plot.

``metrics.jsonl`` holds one JSON object per step (at least ``step``, ``reward/mean``,
``kl``, ``grad_norm``, ``skipped``), flushed every line so a crash loses nothing written.
On resume from step S the lines after S (and a line torn by a crash) are dropped first, by
writing the kept lines to a new file and renaming it over the log (never in place, see
:mod:`portarl.trainer.run.logfiles`), so the file continues without duplicates or losses.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from portarl.trainer.run.logfiles import prepare_log
from portarl.trainer.run.write_failure import WriteFailed, writing

log = logging.getLogger("portarl.train")


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash: skipped (the next start repairs the file)
    return rows


class RunLogger:
    def __init__(self, output_dir: Path, *, total_steps: int, resume_step: int = 0, tensorboard: bool = True,
                 progress: bool = True, trackers=None):
        """``trackers``: the run's other experiment trackers
        (:class:`portarl.trainer.run.trackers.fanout.Trackers`), fed every row after the file;
        the caller finishes them (after the summary and the plot, which they get too)."""
        self.output_dir = output_dir
        self.trackers = trackers
        self.metrics_path = output_dir / "metrics.jsonl"
        self.events_path = output_dir / "events.jsonl"
        for path in (self.metrics_path, self.events_path):  # never rewritten in place: see logfiles
            prepare_log(path, resume_step)
        self._metrics = self.metrics_path.open("a")
        self._events = self.events_path.open("a")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(output_dir / "tensorboard"), purge_step=resume_step + 1)
            except ImportError:
                log.warning("tensorboard is not installed: `pip install tensorboard` for TensorBoard logs")
        # The bar starts at the first GRPO step, not here: an SFT warm-up runs in between
        # (with its own bar) and would otherwise count towards the GRPO ETA.
        self.bar = None
        self._bar_args = (total_steps, resume_step) if progress else None
        self._redirect = None

    def _start_bar(self) -> None:
        from portarl.trainer.run.progress import progress_bar

        total, initial = self._bar_args
        self._bar_args = None
        self.bar = progress_bar(total, "grpo", initial=initial)
        if self.bar is not None:
            # Log lines (events, checkpoints) are written above the bar instead of through it.
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger()])
            self._redirect.__enter__()

    def step(self, metrics: dict) -> None:
        if self._bar_args is not None:
            self._start_bar()
        row = {k: _clean(float(v) if not isinstance(v, (str, int)) else v) for k, v in metrics.items()}
        with writing(self.metrics_path):
            self._metrics.write(json.dumps(row) + "\n")
            self._metrics.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, metrics["step"])
        if self.trackers is not None:  # after the file: a tracker that fails never costs a line of it
            self.trackers.metrics(metrics)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(_postfix(metrics))

    def event(self, step: int, kind: str, message: str, **fields) -> None:
        row = {"step": step, "kind": kind, "message": message, **{k: _clean(v) for k, v in fields.items()}}
        with writing(self.events_path):
            self._events.write(json.dumps(row) + "\n")
            self._events.flush()
        # Once, through logging only (the bar shows log lines above itself).
        log.log(event_level(kind, fields), "step %d: %s", step, message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self.writer is not None:
            self.writer.close()
        failed = None
        for path, handle in ((self.metrics_path, self._metrics), (self.events_path, self._events)):
            try:  # both are closed even when a write failed (closing flushes what is left)
                with writing(path):
                    handle.close()
            except WriteFailed as err:
                failed = failed or err
        if failed is not None:
            raise failed


def finish_run(output_dir: Path, plot: bool) -> str:
    """The end of a run: ``summary.txt`` (and ``curves.png``) from ``metrics.jsonl``;
    returns the summary. A write that fails is a :class:`WriteFailed` naming the file."""
    rows = read_metrics(output_dir / "metrics.jsonl")
    summary = summarize(rows)
    with writing(output_dir / "summary.txt"):
        (output_dir / "summary.txt").write_text(summary + "\n")
    if plot:
        with writing(output_dir / "curves.png"):
            plot_curves(rows, output_dir / "curves.png")
    return summary


#: Log level of each event kind. Spike and drift detectors inform; they warn only when they
#: act (an ``action`` field of skip / stop, once detectors can act).
EVENT_LEVELS = {
    "kl_spike": logging.INFO,
    "grad_norm_spike": logging.INFO,
    "degenerate_rise": logging.INFO,
    "best_checkpoint": logging.INFO,
    "identical_samples": logging.WARNING,
    "skipped_step": logging.WARNING,
    "interrupted": logging.WARNING,
    # The stop is raised (TrainingStopped carries the same message) and the caller reports
    # it: logged at ERROR as well, the CLI printed every stop twice.
    "stopped": logging.DEBUG,
}


def event_level(kind: str, fields: dict | None = None) -> int:
    action = (fields or {}).get("action")
    if action in ("skip", "stop"):
        return logging.WARNING if action == "skip" else logging.ERROR
    return EVENT_LEVELS.get(kind, logging.WARNING)


def _postfix(metrics: dict) -> dict:
    """The bar's numbers; a metric the step does not have is left out, not shown as nan."""
    out = {}
    for key, label, fmt in (("reward/mean", "reward", ".3f"), ("kl", "kl", ".2e"), ("grad_norm", "gnorm", ".2f")):
        value = metrics.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[label] = format(value, fmt)
    out["skip"] = int(metrics.get("guard/skipped_total", 0))
    return out


def summarize(rows: list[dict], window: int = 10) -> str:
    """Reward and accuracy at the start and end of the run (with tools or an environment,
    what an episode did: tool calls, environment steps, turns), and what the guards saw."""
    if not rows:
        return "no steps logged"
    grpo = [r for r in rows if r.get("phase", "grpo") == "grpo"]
    head, tail = grpo[:window], grpo[-window:]

    def mean(rs, key):
        vals = [r[key] for r in rs if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else float("nan")

    def has(key):
        return any(isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) for r in grpo)

    lines = [
        f"steps logged: {len(grpo)} (GRPO)",
        f"reward/mean   first {len(head)} steps: {mean(head, 'reward/mean'):.3f}   last {len(tail)} steps: {mean(tail, 'reward/mean'):.3f}",
    ]
    if has("reward/math_exact"):  # accuracy only means something when math_exact is a reward
        lines.append(f"accuracy      first {len(head)} steps: {mean(head, 'reward/math_exact'):.3f}   "
                     f"last {len(tail)} steps: {mean(tail, 'reward/math_exact'):.3f}")
    agent = [(key, label) for key, label in (("agent/tool_calls", "tool calls"), ("agent/tool_success_frac", "tool success"),
                                             ("agent/env_steps", "environment steps"), ("agent/turns_mean", "turns"))
             if has(key)]
    if agent:  # tools / an environment: that they ran, per episode (docs/agents.md, "Metrics and samples")
        def per_episode(rs):
            return ", ".join(f"{label} {mean(rs, key):.2f}" for key, label in agent)

        lines.append(f"per episode   first {len(head)} steps: {per_episode(head)}   last {len(tail)} steps: {per_episode(tail)}")
    evals = [(r["step"], r["eval/reward/mean"]) for r in grpo if isinstance(r.get("eval/reward/mean"), (int, float))]
    if evals:
        best = max(evals, key=lambda e: e[1])
        lines.append(f"eval/reward/mean   first (step {evals[0][0]}): {evals[0][1]:.3f}   last (step {evals[-1][0]}): "
                     f"{evals[-1][1]:.3f}   best (step {best[0]}): {best[1]:.3f}")
    last = [f"{label} (mean of last {len(tail)} steps): {mean(tail, key):{fmt}}" for key, label, fmt in (("kl", "kl", ".3e"), ("grad_norm", "grad_norm", ".3f"))
            if has(key)]
    if last:
        lines.append("   ".join(last))
    guards = (f"skipped steps: {int(sum(r.get('skipped', 0) for r in grpo))}   "
              f"spikes: {int(sum(r.get('guard/spike', 0) for r in grpo))}")
    if has("rollout/identical_group_frac"):
        guards += f"   identical-group frac (mean): {mean(grpo, 'rollout/identical_group_frac'):.3f}"
    lines.append(guards)
    return "\n".join(lines)


def plot_curves(rows: list[dict], path: Path) -> Path | None:
    """reward, kl and grad-norm against step, as a PNG (needs matplotlib; skipped without)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    grpo = [r for r in rows if r.get("phase", "grpo") == "grpo"]
    if not grpo:
        return None
    keys = [("reward/mean", "reward"), ("reward/math_exact", "accuracy"), ("eval/reward/mean", "eval reward"),
            ("kl", "kl"), ("grad_norm", "grad norm")]
    series = {key: [(r["step"], r[key]) for r in grpo if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
              for key, _ in keys}
    keys = [(key, title) for key, title in keys if series[key]]  # no empty panels (accuracy without math_exact)
    if not keys:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3), squeeze=False)
    for ax, (key, title) in zip(axes[0], keys):
        ax.plot(*zip(*series[key]))
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
