"""``portarl bench async``: colocated vs asynchronous rollout on one config, for the same
wall-clock budget of GRPO steps, compared two ways.

Each run is ``portarl train`` in a fresh process (same config and ``--set`` overrides) until
the sum of its steps' ``time/step_s`` (the first GRPO step, which in async mode includes
the worker's start-up, left out) reaches ``--budget-s``; then it gets SIGTERM (it finishes
the step and saves) and the next run starts. The runs, with T = ``--threads``:

* ``colocated``: T threads, the trainer's process alone;
* ``async``: T threads in the trainer and T in the rollout worker (two processes);
* ``partial`` and ``partial_carry``: async with ``rollout.partial`` at the config's
  ``max_staleness`` and at 2 (tokens carried into later batches), as ``async``
  (``--no-partial`` leaves them out);
* ``colocated_same_cores``: 2T threads, i.e. the cores the two async processes use, given
  to colocated mode's intra-op parallelism (``--no-same-cores`` leaves it out).

Two comparisons follow. **A core per process** (async against ``colocated``): a colocated
step costs R + T (rollout ``time/rollout_s``, the rest T); an async step at best max(R, T')
when each process has its own core (T' the async trainer's step), so the ideal speed-up is
(R + T) / max(R, T), from the colocated run's phase times. It is reported twice: in wall
time (samples per second, which a shared, loaded machine skews: a process waiting for a
core is slower in wall time only), and in process CPU time (``time/step_cpu_s`` /
``time/rollout_cpu_s`` of the trainer, ``rollout/cpu_s`` of the worker: the colocated step's
CPU time over the larger of the async trainer's step and the worker's batch), which counts
what each process's own work costs, including what async adds (publishing the weights, the
JSON transfer) and what the two processes cost each other (shared caches and memory
bandwidth), but not waiting for a core. **The same cores** (async against
``colocated_same_cores``): samples per second only. On a CPU the rollout's overlap competes
with intra-op threads for the same cores; async pays where the rollout has a device (or
cores) of its own. Reported per run: GRPO steps and samples trained inside the budget,
samples per second, the phase times in wall and CPU time, the mean reward of the last
steps, and reward/mean at equal sample counts (the learning curve).
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The runs: (name, rollout.mode, threads per process as a multiple of --threads, extra settings).
RUNS = (("colocated", "colocated", 1, ()), ("async", "async", 1, ()),
        ("partial", "async", 1, ("rollout.partial=true",)),
        ("partial_carry", "async", 1, ("rollout.partial=true", "rollout.max_staleness=2")),
        ("colocated_same_cores", "colocated", 2, ()))
#: The runs with a rollout worker (its threads are the trainer's again).
WORKER_RUNS = ("async", "partial", "partial_carry")
#: The partial-rollout runs: at the config's max_staleness (1 by default: no token carried
#: into a later batch) and at 2 (carry-over: portarl/rollout/partial_schedule.py).
PARTIAL_RUNS = ("partial", "partial_carry")
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
             progress=print, lengths: str | None = None) -> list[dict]:
    """One ``portarl train`` in ``mode`` until ``budget_s`` of steps; its GRPO rows inside the
    budget. ``lengths``: benchmark completion lengths (:mod:`portarl.rollout.bench_lengths`)."""
    from portarl.rollout.bench_lengths import ENV

    cmd = [sys.executable, "-m", "portarl", "train", "--output-dir", str(out), "--overwrite"]
    cmd += ["--config", config] if config else []
    for item in [*sets, *QUIET, f"rollout.mode={mode}"]:
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.pop(ENV, None)
    if lengths:
        env[ENV] = lengths
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
            "step_cpu_s_median": _median(rows, "time/step_cpu_s"),
            "reward_last_fifth": statistics.fmean(r["reward/mean"] for r in tail),
            "reward_mean": statistics.fmean(r["reward/mean"] for r in rows),
            "rollout_s_median": _median(rows, "time/rollout_s"),
            "rollout_cpu_s_median": _median(rows, "time/rollout_cpu_s"),
            "gen_s_median": _median(rows, "rollout/gen_s"),
            "worker_cpu_s_median": _median(rows, "rollout/cpu_s"),
            "publish_s_median": _median(rows, "rollout/publish_s"),
            "train_wait_s_median": _median(rows, "train/wait_s"),
            "staleness_mean": statistics.fmean(r.get("rollout/staleness_mean", 0.0) for r in rows),
            "token_staleness_mean": statistics.fmean(r.get("rollout/token_staleness_mean", 0.0) for r in rows),
            "mismatch_abs_diff_mean": statistics.fmean(r.get("mismatch/abs_diff_mean", 0.0) for r in rows)}


def _ideal(step: float, rollout: float) -> float:
    """(R + T) / max(R, T) for a colocated step of ``step`` whose rollout took ``rollout``."""
    return step / max(rollout, step - rollout)


def comparisons(summaries: dict) -> dict:
    """The speed-ups of async (see the module docstring) from the runs' summaries."""
    col, asy = summaries["colocated"], summaries["async"]
    out = {"speedup_measured": asy["samples_per_s"] / col["samples_per_s"],
           "speedup_ideal": _ideal(col["step_s_median"], col["rollout_s_median"])}
    out["measured_of_ideal"] = out["speedup_measured"] / out["speedup_ideal"]
    cpu_step, cpu_rollout = col["step_cpu_s_median"], col["rollout_cpu_s_median"]
    async_cpu = max(asy["step_cpu_s_median"], asy["worker_cpu_s_median"])
    if all(math.isfinite(v) for v in (cpu_step, cpu_rollout, async_cpu)):  # runs from before the CPU metrics: n/a
        out["speedup_cpu"] = cpu_step / async_cpu
        out["speedup_ideal_cpu"] = _ideal(cpu_step, cpu_rollout)
        out["cpu_of_ideal"] = out["speedup_cpu"] / out["speedup_ideal_cpu"]
    if "colocated_same_cores" in summaries:
        out["speedup_same_cores"] = asy["samples_per_s"] / summaries["colocated_same_cores"]["samples_per_s"]
    for name in PARTIAL_RUNS:  # partial rollouts against today's async mode, the same processes and cores
        if name in summaries:
            out[f"{name}_vs_async"] = summaries[name]["samples_per_s"] / asy["samples_per_s"]
            out[f"{name}_vs_colocated"] = summaries[name]["samples_per_s"] / col["samples_per_s"]
    return out


def curve(rows: list[dict], steps: int, chunks: int = 5) -> list[float]:
    """reward/mean averaged over ``chunks`` equal spans of the first ``steps`` steps (fewer
    spans when there are fewer steps than spans)."""
    rows = rows[:steps]
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
    runs = [r for r in RUNS if (r[0] != "colocated_same_cores" or getattr(args, "same_cores", True))
            and (r[0] not in PARTIAL_RUNS or getattr(args, "partial", True))]
    if args.reuse:  # an older work dir may hold no same-cores or partial run
        runs = [r for r in runs if r[0] not in ("colocated_same_cores", *PARTIAL_RUNS) or (work / r[0] / "run").exists()]
    results, threads = {}, {}
    for name, mode, times, extra in runs:
        (work / name).mkdir(parents=True, exist_ok=True)
        threads[name] = args.threads * times
        if args.reuse:  # report on the runs already in --work-dir
            rows = budget_rows(work / name / "run", args.budget_s)
        else:
            rows = run_mode(mode, args.config, [*(args.set or []), *extra], args.budget_s, threads[name],
                            work / name / "run", progress, lengths=getattr(args, "lengths", None))
        if len(rows) < 3:
            raise RuntimeError(f"the {name} run trained {len(rows)} steps in {args.budget_s:g} s: raise --budget-s")
        results[name] = {"summary": {**summarize(rows, samples_per_step), "threads": threads[name]}, "rows": rows}
    summaries = {name: r["summary"] for name, r in results.items()}
    common = min(s["steps"] for s in summaries.values())
    result = {"config": args.config or "demo", "sets": list(args.set or []), "budget_s": args.budget_s,
              "lengths": getattr(args, "lengths", None),
              "threads": args.threads, "cpus": os.cpu_count(),
              "load_avg_1m": {name: _load(work / name) for name in results},
              "samples_per_step": samples_per_step, **summaries, **comparisons(summaries),
              "curve_steps": common, "curve": {m: curve(results[m]["rows"], common) for m in results},
              "reward_per_step": {m: [r["reward/mean"] for r in results[m]["rows"]] for m in results},
              "step_s_per_step": {m: [r["time/step_s"] for r in results[m]["rows"]] for m in results}}
    if args.out:
        plot(result, Path(args.out).with_suffix(".png"))
    return result, table(result)


def plot(result: dict, path: Path) -> None:
    """Left: samples trained against seconds of steps (the speed); right: reward/mean against
    samples trained (a moving mean over 10 steps), every run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (speed, ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    n = result["samples_per_step"]
    for mode, times in result.get("step_s_per_step", {}).items():  # the first step (start-up) not counted
        clock = [sum(times[1:i + 1]) for i in range(len(times))]
        speed.plot(clock, [(i + 1) * n for i in range(len(times))], label=mode)
    speed.set_xlabel("seconds of GRPO steps")
    speed.set_ylabel("samples trained")
    speed.set_title("speed")
    speed.legend(fontsize=8)
    for mode, values in result["reward_per_step"].items():
        window = [statistics.fmean(values[max(0, i - 9):i + 1]) for i in range(len(values))]
        ax.plot([(i + 1) * n for i in range(len(values))], window, label=mode)
    ax.set_xlabel("samples trained")
    ax.set_ylabel("reward/mean (10-step mean)")
    ax.set_title(f"{result['config']}: {result['budget_s']:g} s per mode"
                 + (f", lengths {result['lengths']}" if result.get("lengths") else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _s(v) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.3f}"


def table(res: dict) -> str:
    names = [n for n, *_ in RUNS if n in res]
    col = res["colocated"]
    lines = [f"# bench async: {res['config']} {' '.join(res['sets'])}".rstrip()
             + (f" (completion lengths {res['lengths']}, set by the benchmark)" if res.get("lengths") else ""), "",
             f"{res['budget_s']:g} s of GRPO steps per run, {res['cpus']} CPUs, 1-min load average at the end of "
             "each run: " + ", ".join(f"{m} {v if v is not None else 'n/a'}" for m, v in res["load_avg_1m"].items()),
             "", "Per step, medians (s; CPU: process CPU time; the async run's rollout is the worker's batch: "
             "generation and rewards, and its CPU time since the previous batch):", "",
             "| run | threads | steps | samples | samples/s | step | step CPU | rollout | rollout CPU | publish "
             "| trainer wait | reward (mean / last fifth) | staleness | \\|d\\| rollout vs trainer |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        s = res[name]
        asy = name in WORKER_RUNS
        threads = f"{s['threads']} + {s['threads']}" if asy else str(s["threads"])
        lines.append(
            f"| {name} | {threads} | {s['steps']} | {s['samples']} | {s['samples_per_s']:.2f} | "
            f"{_s(s['step_s_median'])} | {_s(s.get('step_cpu_s_median'))} | "
            f"{_s(s['gen_s_median'] if asy else s['rollout_s_median'])} | "
            f"{_s(s.get('worker_cpu_s_median') if asy else s.get('rollout_cpu_s_median'))} | "
            f"{_s(s.get('publish_s_median')) if asy else '-'} | {_s(s.get('train_wait_s_median')) if asy else '-'} | "
            f"{s.get('reward_mean', float('nan')):.3f} / {s['reward_last_fifth']:.3f} | {s['staleness_mean']:.2f} | "
            f"{s['mismatch_abs_diff_mean']:.2e} |")
    lines += ["", f"**A core per process** (async {res['threads']} + {res['threads']} threads against colocated "
              f"{res['threads']}): measured {res['speedup_measured']:.2f}x in samples per second, ideal "
              f"{res['speedup_ideal']:.2f}x (colocated rollout {col['rollout_s_median']:.3f} s of a "
              f"{col['step_s_median']:.3f} s step: (R + T) / max(R, T)), {res['measured_of_ideal']:.2f} of the ideal."]
    if "speedup_cpu" in res:
        lines[-1] += (f" In process CPU time: {res['speedup_cpu']:.2f}x against an ideal {res['speedup_ideal_cpu']:.2f}x "
                      f"({res['cpu_of_ideal']:.2f} of it; colocated step {col['step_cpu_s_median']:.3f} s with "
                      f"rollout {col['rollout_cpu_s_median']:.3f} s; async trainer step "
                      f"{res['async']['step_cpu_s_median']:.3f} s, worker batch {res['async']['worker_cpu_s_median']:.3f} s).")
    for name, what in (("partial", "rollout.partial"), ("partial_carry", "rollout.partial, max_staleness 2")):
        if f"{name}_vs_async" not in res:
            continue
        part = res[name]
        lines += ["", f"**Partial rollouts, {name}** ({what}, {res['threads']} + {res['threads']} threads): "
                  f"{res[f'{name}_vs_async']:.2f}x async's samples per second and {res[f'{name}_vs_colocated']:.2f}x "
                  f"colocated's ({part['samples_per_s']:.2f} against {res['async']['samples_per_s']:.2f} and "
                  f"{col['samples_per_s']:.2f}); reward per sample {part['reward_mean']:.3f} against async's "
                  f"{res['async']['reward_mean']:.3f}; mean token staleness {part['token_staleness_mean']:.2f}."]
    if "speedup_same_cores" in res:
        same = res["colocated_same_cores"]
        lines += ["", f"**The same cores** (async {res['threads']} + {res['threads']} threads against colocated "
                  f"{same['threads']}): {res['speedup_same_cores']:.2f}x in samples per second "
                  f"({res['async']['samples_per_s']:.2f} against {same['samples_per_s']:.2f})."]
    lines += ["", f"reward/mean over the first {res['curve_steps']} steps of each run, in five equal spans "
              "(same samples):", "",
              "| run | " + " | ".join(f"span {i + 1}" for i in range(len(res['curve']['colocated']))) + " |",
              "|---|" + "---|" * len(res['curve']['colocated'])]
    for mode, values in res["curve"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    return "\n".join(lines) + "\n"


__all__ = ["main", "run_mode", "summarize", "table"]
