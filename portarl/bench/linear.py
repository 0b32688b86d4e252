"""Benchmark of ``ops.linear_logprobs`` (hidden states + lm head -> per-token log-probs).

Methods, each ``fwd`` and ``fwd+bwd`` (gradients for hidden and weight):
- ``portarl:<backend>``: the fused op (the Triton backend is skipped on CPU: interpreted);
- ``eager``: ``F.linear`` in the inputs' dtype, then ``log_softmax(float)`` + gather: the
  N x V logits, their fp32 copy and their gradients all exist;
- ``chunked``: TRL-style, ``F.linear`` + selective log-softmax one chunk of
  :data:`CHUNK_ROWS` rows at a time (bounded forward; autograd keeps every chunk's logits);
- ``liger``: Liger-Kernel's fused linear cross-entropy (``reduction="none"``), where installed.

Timing alternates the methods within each repeat (a loaded machine drifts) and reports the
median; peak extra memory (live tensor bytes torch allocates on CPU, the allocator peak on
CUDA) is measured on the untimed warm-up call.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from portarl import ops
from portarl.backends import BACKEND_NAMES, get_backend_by_name
from portarl.bench.kernels import KernelResult, peak_extra_bytes, synchronize

CHUNK_ROWS = 1024
#: (N, H, V): the committed CPU table; CUDA adds larger N.
CPU_LINEAR_SHAPES = [(1024, 896, 151936), (4096, 896, 151936)]
CUDA_LINEAR_SHAPES = [(4096, 896, 151936), (16384, 896, 151936), (8192, 3584, 152064)]
QUICK_LINEAR_SHAPES = [(64, 32, 512)]


def eager(hidden, weight, labels):
    logits = F.linear(hidden, weight)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def chunked(hidden, weight, labels):
    out = []
    for start in range(0, hidden.shape[0], CHUNK_ROWS):
        logits = F.linear(hidden[start : start + CHUNK_ROWS], weight).float()
        picked = logits.gather(-1, labels[start : start + CHUNK_ROWS].unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(logits, dim=-1))
    return torch.cat(out)


def liger(hidden, weight, labels):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return -LigerFusedLinearCrossEntropyLoss(reduction="none")(weight, hidden, labels)


def fused(backend):
    return lambda hidden, weight, labels: ops.linear_logprobs(hidden, weight, labels, backend=backend)


def linear_methods(device: torch.device) -> dict[str, Callable]:
    methods = {}
    for name in BACKEND_NAMES:
        if name == "cuda" and device.type == "cpu":
            continue
        if get_backend_by_name(name).unavailable_reason(device) is None:
            methods[f"portarl:{name}"] = fused(name)
    methods["eager"] = eager
    methods["chunked"] = chunked
    if device.type == "cuda":
        try:
            import liger_kernel  # noqa: F401

            methods["liger"] = liger
        except ImportError:
            pass
    return methods


def _call(fn, hidden, weight, labels, backward):
    def call():
        if not backward:
            with torch.no_grad():
                return fn(hidden, weight, labels)
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        fn(h, w, labels).sum().backward()
        return h.grad, w.grad

    return call


def run_linear(device: torch.device, *, shapes=None, dtypes=("bf16",), repeats: int = 3,
               progress: Callable[[str], None] | None = None) -> list[KernelResult]:
    shapes = shapes or (CUDA_LINEAR_SHAPES if device.type == "cuda" else CPU_LINEAR_SHAPES)
    dtype_map = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    results = []
    gen = torch.Generator().manual_seed(0)
    for n, h, v in shapes:
        for dname in dtypes:
            dtype = dtype_map[dname]
            hidden = torch.randn(n, h, generator=gen).to(dtype).to(device)
            weight = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype).to(device)
            labels = torch.randint(0, v, (n,), generator=gen).to(device)
            for mode in ("fwd", "fwd+bwd"):
                calls = {name: _call(fn, hidden, weight, labels, mode == "fwd+bwd")
                         for name, fn in linear_methods(device).items()}
                rows = {name: KernelResult("linear_logprobs", name, mode, dname, n, v) for name in calls}
                times: dict[str, list[float]] = {name: [] for name in calls}
                for name, call in calls.items():  # warm-up, and the memory measurement
                    try:
                        rows[name].peak_extra_mb = peak_extra_bytes(call, device) / 2**20
                    except (RuntimeError, MemoryError, NotImplementedError) as err:
                        rows[name].error = f"{type(err).__name__}: {str(err)[:160]}"
                for _ in range(repeats):
                    for name, call in calls.items():
                        if rows[name].error:
                            continue
                        synchronize(device)
                        start = time.perf_counter()
                        call()
                        synchronize(device)
                        times[name].append((time.perf_counter() - start) * 1e3)
                for name, row in rows.items():
                    if times[name]:
                        row.median_ms = statistics.median(times[name])
                    results.append(row)
                    if progress:
                        progress(f"linear_logprobs {name:<18} {mode:<8} {dname} N={n} H={h} V={v}: "
                                 + (f"{row.median_ms:.1f} ms, {row.peak_extra_mb:.0f} MiB" if row.median_ms
                                    else f"skipped ({row.error})"))
            del hidden, weight, labels
    return results


def linear_table(results: list[KernelResult], conditions: str) -> str:
    lines = [f"Conditions: {conditions}", "",
             "| N | V | dtype | mode | method | median ms | peak extra MiB | vs eager (time) | vs eager (memory) |",
             "|---|---|---|---|---|---|---|---|---|"]
    eager_rows = {(r.n, r.v, r.dtype, r.mode): r for r in results if r.method == "eager" and r.median_ms}
    for r in results:
        if r.median_ms is None:
            lines.append(f"| {r.n} | {r.v} | {r.dtype} | {r.mode} | {r.method} | - | - | - | {r.error} |")
            continue
        e = eager_rows.get((r.n, r.v, r.dtype, r.mode))
        rel_t = f"{r.median_ms / e.median_ms:.2f}x" if e else "-"
        rel_m = f"{r.peak_extra_mb / e.peak_extra_mb:.3f}x" if e and e.peak_extra_mb else "-"
        lines.append(f"| {r.n} | {r.v} | {r.dtype} | {r.mode} | {r.method} | {r.median_ms:.1f} | "
                     f"{r.peak_extra_mb:.1f} | {rel_t} | {rel_m} |")
    return "\n".join(lines) + "\n"
