"""Benchmark of ``ops.linear_logprobs`` (hidden states + lm head -> per-token log-probs).

Methods, each ``fwd`` and ``fwd+bwd`` (gradients for hidden and weight):
- ``portarl:<backend>``: the fused op (the Triton backend is skipped on CPU: interpreted);
- ``eager``: ``F.linear`` in the inputs' dtype, then ``log_softmax(float)`` + gather: the
  N x V logits, their fp32 copy and their gradients all exist;
- ``chunked``: TRL-style, ``F.linear`` + selective log-softmax one chunk of
  :data:`CHUNK_ROWS` rows at a time (bounded forward; autograd keeps every chunk's logits);
- ``liger``: Liger-Kernel's fused linear cross-entropy (``reduction="none"``, fp32 weight-grad
  accumulation) on CUDA where installed; elsewhere the report says why the column is empty
  (:func:`liger_status`). Liger is never a dependency of portarl.

Timing alternates the methods within each repeat (a loaded machine drifts) and reports the
median; peak extra memory (live tensor bytes torch allocates on CPU, the allocator peak on
CUDA) is measured on the untimed warm-up call.
"""

from __future__ import annotations

import os

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from portarl import ops
from portarl.bench.kernels import KernelResult, benchmarked_backends, compiled, peak_extra_bytes
from portarl.parity.record import synchronize

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
    """Liger-Kernel's fused linear cross-entropy, per token (``reduction="none"``): logp = -loss.

    ``accum_dtype=torch.float32``: its weight gradient accumulated in fp32, as portarl's is
    (Liger's default accumulates in the parameters' dtype)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(reduction="none", accum_dtype=torch.float32)
    return -loss(weight, hidden, labels)


def liger_status(device: torch.device) -> str | None:
    """None when the Liger column can be measured on ``device``, else why not (for the report)."""
    if device.type != "cuda":
        return "needs CUDA"
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "not installed"
    return None


def fused(backend):
    return lambda hidden, weight, labels: ops.linear_logprobs(hidden, weight, labels, backend=backend)


def fused_head(head: str):
    """The cuda backend with ``head`` forced (:mod:`portarl.backends.cuda.linear_heads`)."""
    from portarl.backends.cuda import linear_heads

    def call(hidden, weight, labels):
        saved = os.environ.get(linear_heads.HEAD_ENV)
        os.environ[linear_heads.HEAD_ENV] = head
        try:
            return ops.linear_logprobs(hidden, weight, labels, backend="cuda")
        finally:
            if saved is None:
                del os.environ[linear_heads.HEAD_ENV]
            else:
                os.environ[linear_heads.HEAD_ENV] = saved

    return call


def linear_methods(device: torch.device, compile: bool = False) -> dict[str, Callable]:
    """Every method timed; on a GPU the cuda backend once per head (split, cublas, tile), so a
    loan times each head the run-time choice picks between."""
    methods = {}
    for name in benchmarked_backends(device):
        if name == "cuda" and device.type == "cuda":
            from portarl.backends.cuda.linear_heads import HEADS

            methods.update({f"portarl:cuda/{head}": fused_head(head) for head in HEADS})
        else:
            methods[f"portarl:{name}"] = fused(name)
    methods["eager"] = eager
    methods["chunked"] = chunked
    if compile:
        methods["compile"] = compiled(eager)
    if liger_status(device) is None:
        methods["liger"] = liger
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


MODES = ("fwd", "fwd+bwd")


def run_linear(device: torch.device, *, shapes=None, dtypes=("bf16",), repeats: int = 3, modes=MODES,
               progress: Callable[[str], None] | None = None, compile: bool = False,
               only: set[str] | None = None) -> list[KernelResult]:
    """Time and peak extra memory of every method on every (shape, dtype, mode). ``modes``
    may drop ``fwd+bwd``: on a CPU without native bf16 GEMMs, eager's backward at N 4096 x
    V 151,936 takes many minutes per call. ``compile``: add ``torch.compile`` of the eager
    formula; ``only``: time just these methods."""
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes {list(modes)!r}: choose from {list(MODES)}")
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
            for mode in modes:
                calls = {name: _call(fn, hidden, weight, labels, mode == "fwd+bwd")
                         for name, fn in linear_methods(device, compile).items() if only is None or name in only}
                rows = {name: KernelResult("linear_logprobs", name, mode, dname, n, v, h=h) for name in calls}
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


def _cell(row: KernelResult | None) -> str:
    if row is None:
        return "-"
    if row.median_ms is None:
        return row.error or "-"
    return f"{row.median_ms:.1f} ms / {row.peak_extra_mb:.1f} MiB"


def linear_table(results: list[KernelResult], conditions: str, *, liger: str | None = None) -> str:
    """Markdown: one row per (shape, dtype, mode), one column per method (median time / peak
    extra memory), then each portarl backend relative to eager. ``liger`` is
    :func:`liger_status`: where not None, the Liger column says why it is empty."""
    methods = list(dict.fromkeys(r.method for r in results))
    fused_methods = [m for m in methods if m.startswith("portarl:")]
    others = [m for m in methods if m not in ("eager", "liger") and m not in fused_methods]
    columns = ["eager", *others, *fused_methods, "liger"]
    note = "measured" if liger is None else liger
    lines = [f"Conditions: {conditions}", f"liger: {note}", "",
             "| N | H | V | dtype | mode | " + " | ".join(columns) + " | "
             + " | ".join(f"{m} vs eager (time, memory)" for m in fused_methods) + " |",
             "|" + "---|" * (5 + len(columns) + len(fused_methods))]
    cases = list(dict.fromkeys((r.n, r.h, r.v, r.dtype, r.mode) for r in results))
    for case in cases:
        by_method = {r.method: r for r in results if (r.n, r.h, r.v, r.dtype, r.mode) == case}
        cells = []
        for m in columns:
            if m == "liger" and liger is not None:
                cells.append(f"liger: {liger}")
            else:
                cells.append(_cell(by_method.get(m)))
        e = by_method.get("eager")
        for m in fused_methods:
            f = by_method.get(m)
            if f is None or f.median_ms is None or e is None or not e.median_ms:
                cells.append("-")
                continue
            rel_m = f"{f.peak_extra_mb / e.peak_extra_mb:.3f}x" if e.peak_extra_mb else "-"
            cells.append(f"{f.median_ms / e.median_ms:.2f}x, {rel_m}")
        n, h, v, dtype, mode = case
        lines.append(f"| {n} | {h if h is not None else '-'} | {v} | {dtype} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
