"""The report of ``portarl bench step``: the machine it ran on and the markdown table.

Kept apart from :mod:`portarl.bench.step` (the driver and the portarl worker) so each module
stays one job. Memory is given three ways per side: the peak resident set (``ru_maxrss``,
imports included), the resident set after the model and tokenizer were loaded (before the
trainer is built), and the increase between them, which is what the GRPO step itself
costs: TRL's imports (datasets, accelerate, pandas) are larger than portarl's and would
otherwise dominate a small model's comparison.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

IMPLS = ("portarl", "portarl-async", "trl")

CONDITIONS = ("The machine is shared with other jobs and loaded: wall times include waiting for a core and "
              "vary with that load; process CPU time counts only this process's own work, so it is the "
              "meaningful number here; phases are given in both. Peak RSS includes each side's imports (TRL pulls "
              "in datasets, accelerate, pandas); the increase is over the resident set after the model was loaded.")


ASYNC_NOTE = ("; portarl-async: rollout.mode async, its trainer and its rollout worker with half of the "
              "{threads} threads each (the same cores as the other sides); its process CPU is the trainer's plus the "
              "worker's, its phases the trainer's (rollout: publishing the weights and waiting for the batch), its "
              "peak RSS the trainer's")


def machine() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        info["memory_gib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):  # pragma: no cover - not POSIX
        pass
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    return info


def _f(v, digits: int) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _ms(v) -> str:
    return "n/a" if v is None else f"{v * 1e3:.1f}"


def _mib(v) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def _schedule(w: dict) -> str:
    if w.get("in_turn") == "steps":
        return ", the two sides taking their steps in turn (first side swapped every step)"
    if w.get("in_turn") == "sides":
        return ", the sides one after the other (never two at once: each side's memory alone)"
    return ""


def markdown(result: dict) -> str:
    s, w, m = result["summary"], result["work"], result["machine"]
    trl = w.get("trl_batching") or {}
    threshold = m.get("malloc_mmap_threshold")
    lines = [f"# `portarl bench step`{' --vs trl' if 'trl' in s else ''}{' --async' if 'portarl-async' in s else ''}", "",
             f"Command: `{result['command']}`  ", f"Machine: {m.get('cpu', '?')}, "
             f"{m['cpu_count']} cores, {m.get('memory_gib', 0):.0f} GiB; torch {m['torch']}, trl "
             f"{m['trl']}; {w['threads']} thread(s) per process; load average at start "
             f"{m['load_average'][0]:.2f}; MALLOC_MMAP_THRESHOLD_ {threshold or 'unset (glibc default)'}.  ",
             f"Work per step: {w['prompts_per_step']} prompts x {w['group_size']} samples, {w['max_new_tokens']} new "
             f"tokens, micro-batches of {w.get('micro_batch_size', 'all')} rows, gradient checkpointing "
             f"{'on' if w.get('gradient_checkpointing') else 'off'}, beta {w['beta']}, lr {w.get('lr', 5e-4)}, temperature "
             f"{w.get('temperature', 1.0)}; reward: {w.get('reward', 'share of digits in the completion')}; prompts: "
             f"{w.get('data', 'synthetic arithmetic (portarl.assets.data)')}; {w['model']}. "
             + (f"TRL: per_device_train_batch_size {trl['per_device_train_batch_size']}, gradient_accumulation_steps "
                f"{trl['gradient_accumulation_steps']}, steps_per_generation {trl['steps_per_generation']}. "
                if trl and 'trl' in s else "")
             + f"{w['steps_per_run']} steps per run, first {w['warmup_steps_dropped']} dropped; {w['rounds']} rounds, "
             f"fresh processes{_schedule(w)}.",
             "",
             result["conditions"], "", "Per step, median over rounds (ms; phases in process CPU time, wall in brackets; "
             "memory in MiB; samples/s: samples per step over the median wall step; reward per sample: over every "
             "step's samples)" + (ASYNC_NOTE.format(threads=w["threads"]) if "portarl-async" in s else "") + ":", "",
             "| impl | process CPU | wall | samples/s | reward per sample | rollout | scoring | update | peak RSS "
             "| after load | increase |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for impl in IMPLS:
        if impl in s:
            x = s[impl]
            ph = " | ".join(f"{_ms(x[f'{p}_cpu_s'])} ({_ms(x[f'{p}_wall_s'])})" for p in ("rollout", "scoring", "update"))
            lines.append(f"| {impl} | {_ms(x['cpu_s'])} | {_ms(x['wall_s'])} | {_f(x.get('samples_per_s'), 2)} | "
                         f"{_f(x.get('reward_mean'), 3)} | {ph} | {_mib(x['peak_rss_mib'])} | "
                         f"{_mib(x.get('baseline_rss_mib'))} | {_mib(x.get('rss_increase_mib'))} |")
    if "ratio_cpu" in s:
        lines += ["", "portarl / TRL per round (CPU, wall): " + ", ".join(
            f"{r['ratio_cpu']:.2f}x / {r['ratio_wall']:.2f}x" for r in result["rounds"]),
            f"**Median ratio: process CPU {s['ratio_cpu']:.2f}x, wall {s['ratio_wall']:.2f}x"
            + (f"; peak RSS {s['ratio_peak_rss']:.2f}x.**" if s.get("ratio_peak_rss") else ".**")]
    if s.get("samples_per_s_vs_trl"):
        lines += ["", "**Samples per second against TRL's: " + ", ".join(
            f"{impl} {ratio:.2f}x" for impl, ratio in s["samples_per_s_vs_trl"].items()) + ".**"]
    return "\n".join(lines) + "\n"
