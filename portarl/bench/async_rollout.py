"""``portarl bench async``: colocated vs asynchronous rollout on one config, for the same
wall-clock budget of GRPO steps.

Each mode runs ``portarl train`` in a fresh process (same config, ``--set`` overrides and
thread count) until the sum of its steps' ``time/step_s`` (the first GRPO step, which in
async mode includes the worker's start-up, left out) reaches ``--budget-s``; then it gets
SIGTERM (it finishes the step and saves) and the next mode starts. Reported per mode:
GRPO steps and samples trained inside the budget, samples per second, the mean reward of
the last steps inside the budget, and reward/mean at equal sample counts (the learning
curve, so that async's stale batches can be judged against colocated's).

The ideal overlap: a colocated step costs R + T (rollout ``time/rollout_s``, the rest T);
an async step at best max(R, T) when the two processes each have a core to themselves, so
the ideal async throughput is the colocated one x (R + T) / max(R, T). On a machine with
fewer free cores than processes the measured figure falls short of it: both are reported.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("colocated", "async")
QUIET = ["logging.progress=false", "logging.tensorboard=false", "logging.plot=false", "logging.samples_every=0",
         "checkpoint.every=1000000", "train.steps=1000000"]


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line being written
            continue
        if row.get("phase") == "grpo":
            rows.append(row)
    return rows


def _budget_used(rows: list[dict]) -> float:
    return sum(r["time/step_s"] for r in rows[1:])


def run_mode(mode: str, config: str | None, sets: list[str], budget_s: float, threads: int, out: Path,
             progress=print) -> list[dict]:
    """One ``portarl train`` in ``mode`` until ``budget_s`` of steps; its GRPO rows inside the budget."""
    cmd = [sys.executable, "-m", "portarl", "train", "--output-dir", str(out), "--overwrite"]
    cmd += ["--config", config] if config else []
    for item in [*sets, *QUIET, f"rollout.mode={mode}"]:
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    log = (out.parent / f"{mode}.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        while proc.poll() is None and _budget_used(_rows(out / "metrics.jsonl")) < budget_s:
            time.sleep(0.2)
        if proc.poll() is not None and proc.returncode != 0:
            raise RuntimeError(f"the {mode} run failed (exit {proc.returncode}); see {log.name}")
        proc.send_signal(signal.SIGTERM)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    (out.parent / "load_avg.txt").write_text(f"{os.getloadavg()[0]:.1f}\n")  # the table reports it
    rows = budget_rows(out, budget_s)
    progress(f"{mode}: {len(rows)} GRPO steps in {budget_s:g} s")
    return rows


def budget_rows(out: Path, budget_s: float) -> list[dict]:
    """The run's GRPO rows whose steps (the first not counted) fit in ``budget_s``."""
    rows, used = [], 0.0
    for i, row in enumerate(_rows(out / "metrics.jsonl")):
        used += row["time/step_s"] if i else 0.0
        if used > budget_s:
            break
        rows.append(row)
    return rows


def _load(run_dir: Path) -> float | None:
    path = run_dir / "load_avg.txt"
    return float(path.read_text()) if path.exists() else None


def _median(rows, key):
    values = [r[key] for r in rows[1:] if key in r]
    return statistics.median(values) if values else float("nan")


def summarize(rows: list[dict], samples_per_step: int) -> dict:
    timed = rows[1:]
    seconds = sum(r["time/step_s"] for r in timed)
    tail = rows[-max(1, len(rows) // 5):]
    return {"steps": len(rows), "samples": len(rows) * samples_per_step,
            "samples_per_s": len(timed) * samples_per_step / seconds if seconds else float("nan"),
            "step_s_median": _median(rows, "time/step_s"),
            "reward_last_fifth": statistics.fmean(r["reward/mean"] for r in tail),
            "rollout_s_median": _median(rows, "time/rollout_s"),
            "gen_s_median": _median(rows, "rollout/gen_s"),
            "train_wait_s_median": _median(rows, "train/wait_s"),
            "staleness_mean": statistics.fmean(r.get("rollout/staleness_mean", 0.0) for r in rows),
            "mismatch_abs_diff_mean": statistics.fmean(r.get("mismatch/abs_diff_mean", 0.0) for r in rows)}


def curve(rows: list[dict], steps: int, chunks: int = 5) -> list[float]:
    """reward/mean averaged over ``chunks`` equal spans of the first ``steps`` steps."""
    size = max(1, steps // chunks)
    return [statistics.fmean(r["reward/mean"] for r in rows[i:i + size]) for i in range(0, size * chunks, size)
            if rows[i:i + size]]


def main(args, progress=print) -> tuple[dict, str]:
    from portarl.trainer.config import TrainConfig

    cfg = TrainConfig.load(args.config, list(args.set or []))
    samples_per_step = cfg.train.prompts_per_step * cfg.rollout.group_size
    if args.reuse and not args.work_dir:
        raise ValueError("--reuse reports on the runs in --work-dir: give --work-dir")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="portarl-bench-async-"))
    results = {}
    for mode in MODES:
        (work / mode).mkdir(parents=True, exist_ok=True)
        if args.reuse:  # report on the runs already in --work-dir
            rows = budget_rows(work / mode / "run", args.budget_s)
        else:
            rows = run_mode(mode, args.config, list(args.set or []), args.budget_s, args.threads,
                            work / mode / "run", progress)
        if len(rows) < 3:
            raise RuntimeError(f"the {mode} run trained {len(rows)} steps in {args.budget_s:g} s: raise --budget-s")
        results[mode] = {"summary": summarize(rows, samples_per_step), "rows": rows}
    col, asy = results["colocated"]["summary"], results["async"]["summary"]
    r, step = col["rollout_s_median"], col["step_s_median"]
    ideal = step / max(r, step - r)
    common = min(col["steps"], asy["steps"])
    result = {"config": args.config or "demo", "sets": list(args.set or []), "budget_s": args.budget_s,
              "threads": args.threads, "cpus": os.cpu_count(),
              "load_avg_1m": {m: _load(work / m) for m in MODES},
              "samples_per_step": samples_per_step, "colocated": col, "async": asy,
              "speedup_measured": asy["samples_per_s"] / col["samples_per_s"], "speedup_ideal": ideal,
              "curve_steps": common, "curve": {m: curve(results[m]["rows"], common) for m in MODES},
              "reward_per_step": {m: [r["reward/mean"] for r in results[m]["rows"]] for m in MODES}}
    if args.out:
        plot(result, Path(args.out).with_suffix(".png"))
    return result, table(result)


def plot(result: dict, path: Path) -> None:
    """reward/mean against samples trained, both modes (a moving mean over 10 steps)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    n = result["samples_per_step"]
    for mode, values in result["reward_per_step"].items():
        window = [statistics.fmean(values[max(0, i - 9):i + 1]) for i in range(len(values))]
        ax.plot([(i + 1) * n for i in range(len(values))], window, label=mode)
    ax.set_xlabel("samples trained")
    ax.set_ylabel("reward/mean (10-step mean)")
    ax.set_title(f"{result['config']}: {result['budget_s']:g} s per mode")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(res: dict) -> str:
    col, asy = res["colocated"], res["async"]
    lines = [f"# bench async: {res['config']} {' '.join(res['sets'])}".rstrip(), "",
             f"{res['budget_s']:g} s of GRPO steps per mode, {res['threads']} thread(s) per process, "
             f"{res['cpus']} CPUs, 1-min load average at the end of each run: "
             + ", ".join(f"{m} {v if v is not None else 'n/a'}" for m, v in res["load_avg_1m"].items()), "",
             "| mode | steps | samples | samples/s | step s (median) | reward (last fifth) | staleness "
             "| |d| rollout vs trainer |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in (("colocated", col), ("async", asy)):
        lines.append(f"| {name} | {s['steps']} | {s['samples']} | {s['samples_per_s']:.1f} | "
                     f"{s['step_s_median']:.3f} | "
                     f"{s['reward_last_fifth']:.3f} | {s['staleness_mean']:.2f} | {s['mismatch_abs_diff_mean']:.2e} |")
    lines += ["", f"Throughput async / colocated: measured {res['speedup_measured']:.2f}x, ideal "
              f"{res['speedup_ideal']:.2f}x (colocated rollout {col['rollout_s_median']:.3f} s of a "
              f"{col['step_s_median']:.3f} s step: (R + T) / max(R, T)).", "",
              f"reward/mean over the first {res['curve_steps']} steps of each run, in five equal spans "
              "(same samples):", "",
              "| mode | " + " | ".join(f"span {i + 1}" for i in range(len(res['curve']['colocated']))) + " |",
              "|---|" + "---|" * len(res['curve']['colocated'])]
    for mode, values in res["curve"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    return "\n".join(lines) + "\n"


__all__ = ["main", "run_mode", "summarize", "table"]
