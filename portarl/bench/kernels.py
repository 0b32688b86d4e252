"""Kernel benchmarks: portarl's log-prob / entropy and KL ops against peers and the hardware.

Methods for ``logprobs``:
- ``portarl:<backend>``: every portarl backend usable on the device (the Triton backend is
  skipped on CPU: interpreted timings mean nothing);
- ``eager``: ``log_softmax(logits.float(), -1).gather(...)`` (and entropy from the same
  N x V fp32 tensor);
- ``rowloop``: a loop in the style of TRL's selective log-softmax: gather the label logits
  at once, then logsumexp one sequence (1024 tokens) at a time to bound peak memory;
- ``liger``: Liger-Kernel's cross-entropy (``reduction="none"``), where installed (CUDA);
- ``compile``: ``torch.compile`` of the eager formula (inductor, ``dynamic=False``), where
  asked for (``compile=True``: each shape, dtype and mode is a compile of its own, seconds
  to tens of seconds, spent in the untimed warm-up).

Modes: ``fwd``, ``fwd+bwd``, each with and without entropy. ``kl``: portarl backends vs the
eager torch formula (k3 with the same clamps), ``fwd`` and ``fwd+bwd``.

Reported per case: median time, peak extra memory (CUDA allocator peak above the inputs;
on CPU the peak of live tensor bytes torch allocates during the call), and achieved
bandwidth (minimum bytes the op must move / time) as a fraction of the device's copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from portarl import ops
from portarl.backends import BACKEND_NAMES, get_backend_by_name
from portarl.parity.record import synchronize

ROWLOOP_SEQUENCE = 1024

CUDA_SHAPES = [(n, v) for n in (4096, 16384, 65536) for v in (32000, 128256, 152064)]
CPU_SHAPES = [(256, 4096), (1024, 4096), (256, 32000), (1024, 32000)]
QUICK_SHAPES = [(64, 512)]


# ----------------------------------------------------------------------------- methods
def eager_logprobs(logits, labels, with_entropy):
    log_sm = torch.log_softmax(logits.float(), dim=-1)
    logp = log_sm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    return logp, -(log_sm.exp() * log_sm).sum(-1)


def rowloop_logprobs(logits, labels, with_entropy):
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float()
    lse, ent = [], []
    for start in range(0, logits.shape[0], ROWLOOP_SEQUENCE):
        rows = logits[start : start + ROWLOOP_SEQUENCE].float()
        row_lse = torch.logsumexp(rows, dim=-1)
        lse.append(row_lse)
        if with_entropy:
            p = torch.softmax(rows, dim=-1)
            ent.append(row_lse - (p * rows).sum(-1))
    logp = picked - torch.cat(lse)
    return logp, (torch.cat(ent) if with_entropy else None)


def liger_logprobs(logits, labels, with_entropy):
    from liger_kernel.transformers import LigerCrossEntropyLoss

    if with_entropy:
        raise NotImplementedError("Liger's cross-entropy has no entropy output")
    return -LigerCrossEntropyLoss(reduction="none")(logits, labels), None


def portarl_logprobs(backend):
    def run(logits, labels, with_entropy):
        out = ops.logprobs(logits, labels, return_entropy=with_entropy, backend=backend)
        return out if with_entropy else (out, None)

    return run


_COMPILED: dict[Callable, Callable] = {}


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)``, made once per formula (a new shape or dtype recompiles, in the
    untimed warm-up call of :func:`median_ms`)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def eager_kl(logp, ref):
    d = (ref.float() - logp.float()).clamp(-20, 20)
    return (d.exp() - d - 1).clamp(max=10)


def portarl_kl(backend):
    return lambda logp, ref: ops.kl(logp, ref, estimator="k3", backend=backend)


def benchmarked_backends(device: torch.device) -> list[str]:
    """The portarl backends timed on ``device``: those available there, without ``cuda``
    on a CPU (its Triton kernels would only run interpreted, which times nothing real)."""
    return [name for name in BACKEND_NAMES if not (name == "cuda" and device.type == "cpu")
            and get_backend_by_name(name).unavailable_reason(device) is None]


def logprob_methods(device: torch.device, compile: bool = False) -> dict[str, Callable]:
    methods = {f"portarl:{name}": portarl_logprobs(name) for name in benchmarked_backends(device)}
    methods["eager"] = eager_logprobs
    if compile:
        methods["compile"] = compiled(eager_logprobs)
    methods["rowloop"] = rowloop_logprobs
    if device.type == "cuda":
        try:
            import liger_kernel  # noqa: F401

            methods["liger"] = liger_logprobs
        except ImportError:
            pass
    return methods


def kl_methods(device: torch.device, compile: bool = False) -> dict[str, Callable]:
    methods = {f"portarl:{n}": portarl_kl(n) for n in benchmarked_backends(device)}
    methods["eager"] = eager_kl
    if compile:
        methods["compile"] = compiled(eager_kl)
    return methods


# ------------------------------------------------------------------------- measuring
class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensors torch allocates (and has not freed) inside the mode."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0

    def _release(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if isinstance(t, torch.Tensor) and not func._schema.is_mutable and not any(
                r.alias_info is not None for r in func._schema.returns
            ):
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t.untyped_storage(), self._release, nbytes)
        return out


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int:
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del result
        return peak
    if device.type == "npu":
        return -1  # not measured here: torch_npu's allocator stats would go through torch_npu_api
    mode = LiveBytes()
    with mode:
        result = fn()
    del result
    return mode.peak


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Device copy bandwidth in bytes/s, read + write counted (as the anchors quote it)."""
    if device.type == "cpu":
        nbytes = min(nbytes, 1 << 26)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / (ms / 1e3)


@dataclasses.dataclass
class KernelResult:
    op: str
    method: str
    mode: str
    dtype: str
    n: int
    v: int
    median_ms: float | None = None
    peak_extra_mb: float | None = None
    gbps: float | None = None
    frac_copy_bw: float | None = None
    error: str | None = None
    h: int | None = None  # linear_logprobs: the hidden size


def shapes_v0(shapes, n: int) -> int:
    return next(v for nn, v in shapes if nn == n)


def _min_bytes(op: str, mode: str, n: int, v: int, elem: int) -> int:
    if op == "kl":  # read logp, ref; write fp32 value (+ bwd: read both and grad_out, write grad)
        return n * (2 * elem + 4) if mode == "fwd" else n * (2 * elem + 4) + n * (2 * elem + 4 + elem)
    logits = n * v * elem
    return logits if mode.startswith("fwd") and "bwd" not in mode else 3 * logits  # bwd: re-read + write grad


def run_kernels(device: torch.device, *, shapes=None, dtypes=("bf16", "fp32"), repeats: int = 5,
                progress: Callable[[str], None] | None = None, compile: bool = False,
                only: set[str] | None = None, modes=None, bandwidth: float | None = None,
                ) -> tuple[list[KernelResult], float]:
    """Every method x mode on every shape and dtype. ``only``: time just these methods;
    ``modes``: just these log-prob modes (KL keeps ``fwd`` / ``fwd+bwd``); ``bandwidth``: the
    copy bandwidth already measured on this device (measured here otherwise)."""
    shapes = shapes or (CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES)
    dtype_map = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    bandwidth = bandwidth or copy_bandwidth(device)
    logprob_modes = modes or ("fwd", "fwd+entropy", "fwd+bwd", "fwd+bwd+entropy")
    results: list[KernelResult] = []
    gen = torch.Generator().manual_seed(0)
    for n, v in shapes:
        for dname in dtypes:
            dtype = dtype_map[dname]
            try:
                logits = (3 * torch.randn(n, v, generator=gen)).to(dtype).to(device)
                labels = torch.randint(0, v, (n,), generator=gen).to(device)
            except (RuntimeError, MemoryError) as err:  # out of memory for this shape
                results.append(KernelResult("logprobs", "-", "-", dname, n, v, error=f"inputs do not fit: {err}"[:200]))
                continue
            cases = []
            for name, fn in logprob_methods(device, compile).items():
                for mode in logprob_modes:
                    cases.append(("logprobs", name, mode, _logprob_call(fn, logits, labels, mode)))
            logp = -torch.rand(n, generator=gen).to(dtype).to(device)  # per-token, as in training
            ref = (logp.float() + 0.3 * torch.randn(logp.shape, generator=gen).to(device)).to(dtype)
            for name, fn in kl_methods(device, compile).items():
                for mode in ("fwd", "fwd+bwd"):
                    cases.append(("kl", name, mode, _kl_call(fn, logp, ref, mode)))
            for op, name, mode, call in cases:
                if only is not None and name not in only:
                    continue
                if op == "kl" and v != shapes_v0(shapes, n):
                    continue  # KL is per token: once per N
                res = KernelResult(op, name, mode, dname, n, v if op == "logprobs" else 0)
                try:
                    res.median_ms = median_ms(call, device, repeats)
                    res.peak_extra_mb = peak_extra_bytes(call, device) / 2**20
                    moved = _min_bytes(op, mode.replace("+entropy", ""), n, v, logits.element_size())
                    res.gbps = moved / (res.median_ms / 1e3) / 1e9
                    res.frac_copy_bw = moved / (res.median_ms / 1e3) / bandwidth
                except NotImplementedError as err:
                    res.error = str(err)
                except (RuntimeError, MemoryError) as err:
                    res.error = f"{type(err).__name__}: {str(err)[:160]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                results.append(res)
                if progress:
                    progress(f"{op:<8} {name:<18} {mode:<16} {dname} N={n} V={v}: "
                             + (f"{res.median_ms:.3f} ms" if res.median_ms is not None else f"skipped ({res.error})"))
            del logits, labels, logp, ref
    return results, bandwidth


def _logprob_call(fn, logits, labels, mode):
    with_entropy = "entropy" in mode
    backward = "bwd" in mode

    def call():
        if not backward:
            with torch.no_grad():
                return fn(logits, labels, with_entropy)
        leaf = logits.detach().requires_grad_(True)
        logp, ent = fn(leaf, labels, with_entropy)
        total = logp.sum() + (ent.sum() if ent is not None else 0.0)
        total.backward()
        return leaf.grad

    return call


def _kl_call(fn, logp, ref, mode):
    def call():
        if mode == "fwd":
            with torch.no_grad():
                return fn(logp, ref)
        a = logp.detach().requires_grad_(True)
        out = fn(a, ref)
        out.sum().backward()
        return a.grad

    return call


def markdown_table(results: list[KernelResult], device_name: str, bandwidth: float) -> str:
    lines = [f"Device: {device_name}; measured copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write).", "",
             "| op | N | V | dtype | mode | method | median ms | peak extra MiB | GB/s | of copy BW |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        v = r.v if r.op == "logprobs" else "-"
        if r.median_ms is None:
            lines.append(f"| {r.op} | {r.n} | {v} | {r.dtype} | {r.mode} | {r.method} | - | - | - | {r.error} |")
            continue
        lines.append(f"| {r.op} | {r.n} | {v} | {r.dtype} | {r.mode} | {r.method} | {r.median_ms:.3f} | "
                     f"{r.peak_extra_mb:.1f} | {r.gbps:.1f} | {r.frac_copy_bw:.0%} |")
    return "\n".join(lines) + "\n"
