"""What every ``portarl bench step`` worker side (:mod:`portarl.bench.step_portarl`,
:mod:`portarl.bench.step_trl`) shares: its thread count, the timing of a step and its
phases, its result, and stepping in turn with the driver (:mod:`portarl.bench.step`).
Below the driver and the sides, which all use it."""

from __future__ import annotations

import functools
import os
import resource
import sys
import time

from portarl.bench.step_work import checkpointing_on


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set in this process
        pass


def timed(acc: dict, key: str, fn):
    """``fn`` wrapped to add its wall and process CPU time to ``acc[key]`` ([wall, cpu])."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = acc.setdefault(key, [0.0, 0.0])
            spent[0] += time.perf_counter() - w0
            spent[1] += time.process_time() - c0

    return wrapper


def step_record(wall: float, cpu: float, phases: dict, started: float | None = None) -> dict:
    """One step; phases ``{name: [wall, cpu]}`` (rollout, scoring); update = the rest;
    ``started``: its start (``time.time()``), to show that sides stepping in turn did not overlap."""
    out = {"wall_s": wall, "cpu_s": cpu, "started_unix": started}
    for i, kind in enumerate(("wall", "cpu")):
        rollout, scoring = (phases[k][i] if k in phases else None for k in ("rollout", "scoring"))
        out[f"rollout_{kind}_s"], out[f"scoring_{kind}_s"] = rollout, scoring
        total = wall if kind == "wall" else cpu
        out[f"update_{kind}_s"] = total - rollout - (scoring or 0.0) if rollout is not None else None
    return out


def finish(steps: list[dict], threads: int, started: float, baseline_mib: float, model) -> dict:
    """A worker's result; ``baseline_mib``: its resident set once the model was loaded;
    ``model``: the policy trained, to record whether checkpointing really was on."""
    import torch

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"steps": steps, "torch_threads": torch.get_num_threads(), "process_s": time.perf_counter() - started,
            "peak_rss_mib": peak, "baseline_rss_mib": baseline_mib, "rss_increase_mib": peak - baseline_mib,
            "threads": threads, "gradient_checkpointing": checkpointing_on(model)}


READY, RESULT = "PORTARL_BENCH_READY", "PORTARL_BENCH_STEP"
GATED = "PORTARL_BENCH_GATED"  # environment: set by the driver when the sides step in turn


def gate() -> None:
    """Before each step of a worker that steps in turn: say so and wait for the driver's go.
    A no-op in a worker run on its own."""
    if not os.environ.get(GATED):
        return
    print(READY, flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("portarl bench step: the driver went away")
