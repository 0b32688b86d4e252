"""Run the seeded parity cases on one device for each backend there and each precision.

For every (backend, dtype, case) the sweep runs the op forward and backward on the device,
the float64 reference on the CPU on the *same input values*, and records, per quantity
(``logp``, ``entropy``, ``grad`` for log-probs; ``value``, ``grad_logp``, ``grad_ref`` for
KL): max abs / relative error, the tolerance from :mod:`portarl.parity.tolerances`,
pass/fail, timing, and a fixed sample of the output values. The samples are what
``portarl parity compare`` holds two devices to, position by position.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from portarl import ops
from portarl.backends import BACKEND_NAMES, get_backend_by_name
from portarl.parity import cases as case_lib
from portarl.parity.float64 import kl_float64, logprobs_float64
from portarl.parity.record import Record, fill, timed
from portarl.parity.tolerances import fp32_result, stored_gradient


def native_backend(device: torch.device) -> str:
    """The backend a device's results are reported under when devices are compared."""
    return {"cuda": "cuda", "npu": "npu"}.get(device.type, "reference")


def report_label(backend: str, device: torch.device | str) -> str:
    """The name a backend's rows carry in a report: ``cuda-interpreted`` for the Triton
    kernels run by the interpreter on a CPU (their numbers are the kernels' arithmetic, not
    a GPU's, and their timings mean little), else the backend's own name."""
    on_cpu = str(device).split(":")[0] == "cpu"  # a string: a report's device may be one torch cannot name here (npu)
    return "cuda-interpreted" if backend == "cuda" and on_cpu else backend


def backends_for(device: torch.device) -> list[str]:
    """Backends that can run on ``device``, the device's own first."""
    names = [native_backend(device)] + [n for n in BACKEND_NAMES if n != native_backend(device)]
    return [n for n in names if get_backend_by_name(n).unavailable_reason(device) is None]


def run_logprobs_case(
    case: case_lib.LogprobsCase, backend: str, dtype: torch.dtype, device: torch.device, repeats: int = 3
) -> list[Record]:
    dtype_name = case_lib.DTYPE_NAMES[dtype]
    base = dict(op="logprobs", case=case.name, backend=backend, dtype=dtype_name)
    logits, labels = case.make(dtype, device)
    gen = torch.Generator().manual_seed(case.seed + 7)
    g_logp = torch.randn(labels.shape, generator=gen)
    g_ent = 0.5 * torch.randn(labels.shape, generator=gen)
    kwargs = dict(temperature=case.temperature, ignore_index=case.ignore_index, return_entropy=True, backend=backend)

    def forward():
        with torch.no_grad():
            return ops.logprobs(logits, labels, **kwargs)

    def forward_backward():
        leaf = logits.detach().requires_grad_(True)
        logp, entropy = ops.logprobs(leaf, labels, **kwargs)
        torch.autograd.backward((logp, entropy), (g_logp.to(device), g_ent.to(device)))
        return logp, entropy, leaf.grad

    try:
        _, forward_ms = timed(forward, device, repeats)
        (logp, entropy, grad), fb_ms = timed(forward_backward, device, repeats)
    except Exception as err:  # a backend that raises is a failed case, reported, not a crashed sweep
        msg = f"{type(err).__name__}: {err}"
        return [Record(**base, quantity=q, error=msg) for q in ("logp", "entropy", "grad")]
    ref = logprobs_float64(
        logits, labels, temperature=case.temperature, ignore_index=case.ignore_index,
        grad_logp=g_logp, grad_entropy=g_ent,
    )
    scale = case.input_scale()
    upstream = float(g_logp.abs().max() + g_ent.abs().max()) / case.temperature if g_logp.numel() else 0.0
    timing = dict(forward_ms=forward_ms, backward_ms=max(0.0, fb_ms - forward_ms))
    return [
        fill(Record(**base, quantity="logp", **timing), logp, ref["logp"], fp32_result(scale), case.seed),
        fill(Record(**base, quantity="entropy", **timing), entropy, ref["entropy"], fp32_result(scale), case.seed),
        fill(
            Record(**base, quantity="grad", **timing), grad, ref["grad"],
            stored_gradient(scale, upstream, dtype), case.seed,
        ),
    ]


def run_kl_case(
    case: case_lib.KLCase, estimator: str, backend: str, dtype: torch.dtype, device: torch.device, repeats: int = 3
) -> list[Record]:
    dtype_name = case_lib.DTYPE_NAMES[dtype]
    base = dict(op="kl", case=f"{case.name}/{estimator}", backend=backend, dtype=dtype_name)
    logp, ref_logp, mask = case.make(dtype, device)
    grad_out = torch.randn(case.shape, generator=torch.Generator().manual_seed(case.seed + 7))

    def forward():
        with torch.no_grad():
            return ops.kl(logp, ref_logp, estimator=estimator, mask=mask, backend=backend)

    def forward_backward():
        a = logp.detach().requires_grad_(True)
        b = ref_logp.detach().requires_grad_(True)
        value = ops.kl(a, b, estimator=estimator, mask=mask, backend=backend)
        value.backward(grad_out.to(device))
        return value, a.grad, b.grad

    try:
        _, forward_ms = timed(forward, device, repeats)
        (value, ga, gb), fb_ms = timed(forward_backward, device, repeats)
    except Exception as err:
        msg = f"{type(err).__name__}: {err}"
        return [Record(**base, quantity=q, error=msg) for q in ("value", "grad_logp", "grad_ref")]
    ref = kl_float64(logp, ref_logp, estimator=estimator, mask=mask, grad_out=grad_out)
    scale = case.input_scale()
    # Magnitudes that set the fp32 error: |d| <= scale; k3 with the default clamps is only
    # unclamped (and so only has a gradient) where exp(d) - d - 1 <= 10, i.e. exp(d) <= 11.
    value_size = {"k1": scale, "k2": scale * scale / 2, "k3": 11.0}[estimator]
    grad_size = {"k1": 1.0, "k2": scale, "k3": 11.0}[estimator]
    upstream = float(grad_out.abs().max())
    timing = dict(forward_ms=forward_ms, backward_ms=max(0.0, fb_ms - forward_ms))
    value_tol = fp32_result(value_size)
    grad_tol = stored_gradient(grad_size, upstream, dtype)
    return [
        fill(Record(**base, quantity="value", **timing), value, ref["value"], value_tol, case.seed),
        fill(Record(**base, quantity="grad_logp", **timing), ga, ref["grad_logp"], grad_tol, case.seed),
        fill(Record(**base, quantity="grad_ref", **timing), gb, ref["grad_ref"], grad_tol, case.seed),
    ]


def run_sweep(
    device: torch.device,
    *,
    backends: Iterable[str] | None = None,
    dtypes: Iterable[str] = ("fp32", "bf16", "fp16"),
    include_hardware_cases: bool = False,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    sink: list[Record] | None = None,
) -> list[Record]:
    """Every case x backend x dtype on ``device``; ``progress`` gets one line per case.
    ``sink``: a list the records are appended to as each case finishes (and returned), so
    that a caller stopped midway still holds what ran."""
    names = list(backends) if backends is not None else backends_for(device)
    dtype_list = [case_lib.parse_dtype(d) for d in dtypes]
    lp_cases = case_lib.standard_logprobs_cases()
    kl_cases = case_lib.standard_kl_cases()
    if include_hardware_cases:
        kl_cases += case_lib.hardware_kl_cases()
    # The Triton interpreter on CPU skips cases too big for it (they run on a real GPU).
    interpreted = device.type == "cpu"
    jobs: list[tuple[str, Callable[[], list[Record]]]] = []
    for backend in names:
        for dtype in dtype_list:
            for case in lp_cases:
                if interpreted and backend == "cuda" and not case.fits_interpreter():
                    continue
                jobs.append((f"logprobs {case.name}", lambda c=case, b=backend, d=dtype: run_logprobs_case(c, b, d, device, repeats)))
            for case in kl_cases:
                for est in ops.KL_ESTIMATORS:
                    jobs.append((f"kl {case.name}/{est}", lambda c=case, e=est, b=backend, d=dtype: run_kl_case(c, e, b, d, device, repeats)))
    if include_hardware_cases:  # case by case, so that each case's inputs are drawn once (LogprobsCase._draws)
        for case in case_lib.hardware_logprobs_cases():
            for backend in names:
                if interpreted and backend == "cuda" and not case.fits_interpreter():
                    continue
                for dtype in dtype_list:
                    jobs.append((f"logprobs {case.name}",
                                 lambda c=case, b=backend, d=dtype: run_logprobs_case(c, b, d, device, repeats)))
    from portarl.parity.linear_sweep import run_linear_logprobs_case, standard_linear_cases

    for backend in names:
        for dtype in dtype_list:
            for case in standard_linear_cases():
                if interpreted and backend == "cuda" and not case.fits_interpreter():
                    continue
                jobs.append((f"linear_logprobs {case.name}",
                             lambda c=case, b=backend, d=dtype: run_linear_logprobs_case(c, b, d, device, repeats)))
    records: list[Record] = sink if sink is not None else []
    width = len(str(len(jobs)))
    for i, (label, job) in enumerate(jobs, 1):
        started = time.perf_counter()
        out = job()
        for record in out:
            record.backend = report_label(record.backend, device)
        records.extend(out)
        if progress is not None:
            status = "ok" if all(r.passed for r in out) else "FAIL"
            progress(
                f"[{i:>{width}}/{len(jobs)}] {out[0].backend:<9} {out[0].dtype:<4} {label:<32} "
                f"{status} ({time.perf_counter() - started:.1f}s)"
            )
    return records
