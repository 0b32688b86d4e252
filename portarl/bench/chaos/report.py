"""The chaos runs' table: per mode, the faults by kind, restarts, time lost, and the verdict
against the uninterrupted run (``portarl bench chaos``, docs/checkpoints.md)."""

from __future__ import annotations

from pathlib import Path

from portarl.bench.chaos.runner import run_chaos


def verdict(r: dict) -> str:
    if not r["ok"]:
        return "FAILED: " + "; ".join([*r["findings"], *r.get("metrics_differences", [])[:2],
                                       *r.get("weights_differences", [])[:2], *r.get("continuation_problems", [])[:2]])
    if r["bitwise"]:
        return "bitwise equal"
    return f"bitwise to step {r['bitwise_until']}, then a valid continuation"


def markdown(results: list[dict]) -> str:
    lines = ["| mode | steps | faults injected (by kind) | restarts | chaos run / uninterrupted (s) | result |",
             "|---|---|---|---|---|---|"]
    for r in results:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["faults_by_kind"].items()))
        lines.append(f"| {r['mode']} | {r['steps']} | {sum(r['faults_by_kind'].values())} ({kinds}) | {r['restarts']} "
                     f"| {r['chaos_s']:.0f} / {r['uninterrupted_s']:.0f} | {verdict(r)} |")
    return "\n".join(lines) + "\n"


def main(args, progress=print):
    """``portarl bench chaos``: each ``--mode`` in turn; (the reports, the table)."""
    work = Path(args.work_dir)
    results = []
    for mode in args.mode:
        r = run_chaos(mode, steps=args.steps, faults=args.faults, seed=args.seed, work_dir=work / mode,
                      checkpoint_every=args.checkpoint_every, progress=progress)
        progress(f"chaos {mode}: {verdict(r)} ({r['restarts']} restarts, {r['time_lost_s']} s lost)")
        results.append(r)
    return {"runs": results}, markdown(results)


__all__ = ["main", "markdown", "verdict"]
