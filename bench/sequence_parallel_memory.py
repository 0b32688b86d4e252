"""Per-rank peak memory of one training forward and backward of one long sequence under
Ulysses sequence parallelism (``train.sequence_parallel_size``), on the CPU over Gloo.

    PYTHONPATH=. python bench/sequence_parallel_memory.py --out bench/results/sequence-parallel-memory-cpu

For each length T (4k, 8k, 16k tokens: a 16-token prompt and T - 16 completion tokens) and
each SP size (1, 2, 4) a fresh torchrun job of SP ranks runs the trainer's scoring path
(:func:`portarl.trainer.phases.ulysses.sp_completion_logprobs`; at SP 1 the whole-sequence
:func:`portarl.trainer.phases.sequences.completion_logprobs`) on a small Qwen2 (hidden 256,
8 heads, 4 key / value heads, MLP 1024, 4 layers; fp32, no activation checkpointing, a plain
model on every rank, so the parameters are the same everywhere and the difference is the
activations), then ``backward()`` of the log-probs' sum.

Memory: each rank's peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``,
the kernel's high-water mark of the process) after the step, minus the same mark after a
64-token warm-up step of the same path (the Python / torch runtime, the model and its
gradients): the step's own peak, per rank; the largest over the job's ranks is reported.
Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (peak per rank against T, one line per
SP size).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

SIZES = (1, 2, 4)
LENGTHS = (4096, 8192, 16384)
MODEL = {"hidden_size": 256, "heads": 8, "kv_heads": 4, "intermediate_size": 1024, "layers": 4}
PROMPT = 16


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _step(model, tokens: int, sp) -> None:
    import torch

    from portarl.trainer.phases.sequences import build_batch, completion_logprobs
    from portarl.trainer.phases.ulysses import sp_completion_logprobs

    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(3, 70, (tokens,), generator=gen).tolist()
    batch = build_batch([ids[:PROMPT]], [ids[PROMPT:]], 0, "cpu")
    if sp is None:
        logp = completion_logprobs(model, batch, temperature=1.0)
    else:
        logp = sp_completion_logprobs(model, batch, sp, temperature=1.0)
    logp.sum().backward()


def worker(tokens: int) -> None:
    import torch
    import torch.distributed as dist

    from portarl.assets.models import build_tiny
    from portarl.runtime.distributed import DistContext
    from portarl.runtime.sequence_parallel import make_group
    from portarl.trainer.phases.ulysses import install_attention

    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp = None
    if world > 1:
        dist.init_process_group("gloo")
        install_attention()
        sp = make_group(DistContext(dist.get_rank(), world, 0, "gloo"), world)
    torch.manual_seed(0)
    model, _ = build_tiny(max_positions=max(LENGTHS) + 64, **MODEL)
    _step(model, 64, sp)  # warm-up: runtime, weights, gradients, the kernels' own buffers
    baseline = _rss()
    started = time.perf_counter()
    _step(model, tokens, sp)
    seconds = time.perf_counter() - started
    peak = _rss() - baseline
    if sp is not None:
        worst = torch.tensor([float(peak)])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        peak = int(worst.item())
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps({"tokens": tokens, "sp": world, "peak_bytes": peak, "baseline_bytes": baseline,
                                      "seconds": round(seconds, 2)}), flush=True)


def run_one(tokens: int, size: int) -> dict:
    from portarl.runtime.distributed import local_launcher

    cmd = [*local_launcher(size), __file__, "--worker", str(tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"T={tokens} SP={size} failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for size in SIZES:
        mine = [r for r in rows if r["sp"] == size]
        ax.plot([r["tokens"] for r in mine], [r["peak_bytes"] / 2**20 for r in mine], marker="o", label=f"SP {size}")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak memory per rank (MiB, RSS above baseline)")
    ax.set_xscale("log", base=2)
    ax.set_title("Ulysses sequence parallelism: one forward + backward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="bench/results/sequence-parallel-memory-cpu")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    rows = []
    for tokens in map(int, args.lengths.split(",")):
        for size in SIZES:
            row = run_one(tokens, size)
            print(f"T={tokens:>6} SP={size}: peak {row['peak_bytes'] / 2**20:8.1f} MiB per rank ({row['seconds']} s)",
                  flush=True)
            rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": MODEL, "prompt_tokens": PROMPT, "dtype": "fp32", "gradient_checkpointing": False,
            "measure": "ru_maxrss after the step minus after a 64-token warm-up step; max over ranks",
            "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".strip(),
            "command": "PYTHONPATH=. python bench/sequence_parallel_memory.py --out " + args.out}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["| tokens | " + " | ".join(f"SP {s} (MiB/rank)" for s in SIZES) + " |",
             "|---:|" + "---:|" * len(SIZES)]
    for tokens in sorted({r["tokens"] for r in rows}):
        cells = [next(r for r in rows if r["tokens"] == tokens and r["sp"] == s)["peak_bytes"] / 2**20 for s in SIZES]
        lines.append(f"| {tokens} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    out.with_suffix(".md").write_text(f"`{meta['command']}`\n\n{meta['measure']}; model {MODEL}, fp32, no "
                                      "activation checkpointing.\n\n" + "\n".join(lines) + "\n")
    _plot(rows, out.with_suffix(".png"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
