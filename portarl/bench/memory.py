"""``portarl bench memory``: one GRPO step's measured peak memory and time, beside the
estimate of :mod:`portarl.trainer.memory.plan` (what ``portarl plan`` prints).

Each measurement is a fresh process (one per rank under ``--nproc N``: torchrun, Gloo, CPU):
it imports torch, transformers and the trainer, reads its resident set size (the
baseline), builds the trainer from the config (model load included), runs one
``train_step`` and reads its peak resident set size (``ru_maxrss``). The *increase* (peak -
baseline) is what portarl's run allocates; it is what the plan estimates. CPU only: RSS is
the device memory there. On a machine shared with other jobs the time varies with their
load; the memory does not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MARK = "PORTARL_BENCH_MEMORY "


def resident_bytes() -> int:
    """The resident set size now (``VmRSS``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0  # pragma: no cover - not Linux


def _warm_up(cfg) -> None:
    """One step of a minute model with ``cfg``'s settings first: every module the step
    imports lazily (rollout, ops, backward kernels, logging) and the thread pools are then
    part of the baseline, not of the increase the plan estimates."""
    import dataclasses
    import gc
    import tempfile

    from portarl.trainer import GRPOTrainer, build_from_config
    from portarl.trainer.config import DataConfig, ModelConfig

    with tempfile.TemporaryDirectory() as out:
        small = dataclasses.replace(cfg, output_dir=out, data=DataConfig(synthetic_size=8),
                                    model=ModelConfig(hidden_size=8, heads=2, kv_heads=1, intermediate_size=8),
                                    rewards=cfg.rewards if cfg.data.path is None else type(cfg)().rewards)
        small.train = dataclasses.replace(cfg.train, prompts_per_step=cfg.train.prompts_per_step, sft_warmup_steps=0)
        model, tokenizer, examples = build_from_config(small)
        GRPOTrainer(model, tokenizer, None, examples, small, device="cpu").train_step()
    gc.collect()


def _worker(config: str | None, sets: list[str], steps: int) -> None:
    import torch  # noqa: F401  (the baseline includes the libraries)
    import transformers  # noqa: F401

    from portarl.trainer import GRPOTrainer, TrainConfig, build_from_config
    from portarl.trainer.memory.plan import estimate_for_config

    cfg = TrainConfig.load(config, sets)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    estimate = estimate_for_config(cfg, devices=world, first_step=steps == 1)
    _warm_up(cfg)
    baseline = resident_bytes()
    started = time.perf_counter()
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    load_s = time.perf_counter() - started
    step_s, cpu_s, skipped = [], [], 0
    for _ in range(steps):
        step_started, cpu_started = time.perf_counter(), time.process_time()
        skipped += trainer.train_step()["skipped"]
        step_s.append(time.perf_counter() - step_started)
        cpu_s.append(time.process_time() - cpu_started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {"rank": int(os.environ.get("RANK", "0")), "baseline_bytes": baseline, "peak_bytes": peak,
              "after_load_peak_bytes": loaded, "increase_bytes": peak - baseline, "load_s": load_s,
              "steps": steps, "step_s": step_s, "step_cpu_s": cpu_s, "skipped": skipped,
              "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
              "estimate_bytes": estimate.peak, "estimate_parts": estimate.parts, "estimate_phase": estimate.phase}
    print(MARK + json.dumps(record), flush=True)
    from portarl.runtime import distributed as pdist

    pdist.shutdown()


def measure(config: str | None, sets: list[str], nproc: int = 1, threads: int = 1, steps: int = 1,
            mmap_threshold: int | None = None) -> list[dict]:
    """``steps`` steps in a fresh process (``nproc`` > 1: torchrun ranks); a record per rank.
    ``mmap_threshold``: glibc's ``MALLOC_MMAP_THRESHOLD_`` for the workers (a fixed
    threshold: freed large tensors go back to the system at once, so RSS follows the live
    tensors; glibc's default raises the threshold up to 32 MiB as large blocks are freed
    and then keeps freed memory of smaller tensors in its heap)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    from portarl.runtime.distributed import local_launcher

    launcher = local_launcher(nproc) if nproc > 1 else [sys.executable]
    cmd = [*launcher, "-m", "portarl.bench.memory", "--worker", "--steps", str(steps)]
    if config:
        cmd += ["--config", config]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    records = [json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or len(records) != nproc:
        raise RuntimeError(f"measurement failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return sorted(records, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    from portarl.trainer.memory.engine import gib

    ap = argparse.ArgumentParser(prog="portarl bench memory")
    ap.add_argument("--config")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--malloc-mmap-threshold", type=int)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.config, args.set, args.steps)
        return 0
    for r in measure(args.config, args.set, args.nproc, args.threads, args.steps, args.malloc_mmap_threshold):
        ratio = r["estimate_bytes"] / max(1, r["increase_bytes"])
        print(f"rank {r['rank']}: measured peak RSS increase {gib(r['increase_bytes'])} (peak {gib(r['peak_bytes'])}, "
              f"baseline {gib(r['baseline_bytes'])}, after load {gib(r['after_load_peak_bytes'])}); estimate "
              f"{gib(r['estimate_bytes'])} ({ratio:.2f}x); steps " + ", ".join(
                  f"{w:.1f} s wall / {c:.1f} s CPU" for w, c in zip(r["step_s"], r["step_cpu_s"])))
        print("  " + json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
