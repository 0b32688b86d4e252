"""The reference backend against eager PyTorch on a CPU (issue 17, item 3).

    python -m portarl.bench.reference_cpu --out bench/results/reference-cpu.md

Methods: ``portarl:reference`` (``ops.logprobs(..., backend="reference")``) and ``eager``
(``log_softmax(logits.float(), -1).gather(...)``); modes ``fwd`` (no grad) and ``fwd+bwd``
(``logp.sum().backward()``); shapes N x V in {1024, 4096} x 32000; bf16 and fp32.

A CPU shared with other work is noisy, so the methods are alternated call by call inside
every round (both see the same load) and the table reports the median over rounds plus
the per-round ratio's median. Peak extra memory is the peak of live tensor bytes torch
allocates during one call (:class:`portarl.bench.kernels.LiveBytes`), inputs excluded.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from portarl import ops
from portarl.bench.kernels import LiveBytes

SHAPES = [(1024, 32000), (4096, 32000)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def eager(logits, labels):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def reference(logits, labels):
    return ops.logprobs(logits, labels, backend="reference")


METHODS = {"portarl:reference": reference, "eager": eager}


def _call(fn, logits, labels, backward):
    if not backward:
        with torch.no_grad():
            return fn(logits, labels)
    leaf = logits.detach().requires_grad_(True)
    fn(leaf, labels).sum().backward()
    return leaf.grad


def _peak_mib(fn, logits, labels, backward) -> float:
    mode = LiveBytes()
    with mode:
        out = _call(fn, logits, labels, backward)
    del out
    return mode.peak / 2**20


def run(rounds: int, shapes=SHAPES, dtypes=tuple(DTYPES)) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n, v in shapes:
        for dname in dtypes:
            logits = (3 * torch.randn(n, v, generator=gen)).to(DTYPES[dname])
            labels = torch.randint(0, v, (n,), generator=gen)
            for backward in (False, True):
                times = {m: [] for m in METHODS}
                for fn in METHODS.values():  # warm-up
                    _call(fn, logits, labels, backward)
                for r in range(rounds):
                    order = list(METHODS.items()) if r % 2 == 0 else list(METHODS.items())[::-1]
                    for name, fn in order:
                        start = time.perf_counter()
                        _call(fn, logits, labels, backward)
                        times[name].append((time.perf_counter() - start) * 1e3)
                ratio = statistics.median(a / b for a, b in zip(times["portarl:reference"], times["eager"]))
                for name, fn in METHODS.items():
                    rows.append(dict(n=n, v=v, dtype=dname, mode="fwd+bwd" if backward else "fwd", method=name,
                                     median_ms=statistics.median(times[name]),
                                     peak_mib=_peak_mib(fn, logits, labels, backward),
                                     ratio=ratio if name == "portarl:reference" else None))
                print(rows[-2], rows[-1], flush=True)
            del logits
    return rows


def markdown(rows, rounds: int, threads: int, load: str, command: str) -> str:
    lines = [
        "# Reference backend vs eager on CPU",
        "",
        f"Command: `{command}`",
        "",
        f"Conditions: {platform.machine()} CPU, torch {torch.__version__}, {threads} thread(s), "
        f"median of {rounds} rounds with the methods alternated inside each round; "
        f"load average before / after: {load}. A shared machine: absolute times are noisy, "
        "the per-round ratio less so.",
        "",
        "| N | V | dtype | mode | method | median ms | reference / eager (median of rounds) | peak extra MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else ""
        lines.append(f"| {r['n']} | {r['v']} | {r['dtype']} | {r['mode']} | {r['method']} | "
                     f"{r['median_ms']:.1f} | {ratio} | {r['peak_mib']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/reference-cpu.md")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    before = os.getloadavg()
    rows = run(args.rounds)
    after = os.getloadavg()
    load = f"{before[0]:.1f} / {after[0]:.1f}"
    command = f"python -m portarl.bench.reference_cpu --rounds {args.rounds} --threads {args.threads} --out {args.out}"
    text = markdown(rows, args.rounds, args.threads, load, command)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
