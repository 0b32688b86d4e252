"""Stage 3: the fused ops at RL shapes against eager PyTorch, ``torch.compile`` and Liger.

Log-softmax-gather with entropy (forward, forward + backward) and the KL estimator on
N x V logits (:mod:`portarl.bench.kernels`), and the fused linear log-probs on N x H hidden
states and a V x H head (:mod:`portarl.bench.linear`): time, GB/s and the share of the
copy bandwidth measured in stage 1 (the memory-bound ops), TFLOP/s and the share of the
measured bf16 matmul throughput (the linear op), peak extra memory.

Order matters on a timed loan: every method but ``torch.compile`` first, for every shape,
then the compiled formulas (seconds of compile each). ``kernels.json`` and ``kernels.md``
are rewritten after every pass (one shape of one op), so a stage stopped at its limit
leaves the rows of every pass it finished.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from portarl.bench.kernels import copy_bandwidth, run_kernels
from portarl.bench.linear import liger_status, run_linear

#: torch.compile is timed on the modes the fused op exists for (log-probs with entropy), and
#: on both linear modes.
COMPILE_LOGPROB_MODES = ("fwd+entropy", "fwd+bwd+entropy")


def run(plan, device: torch.device, out, work, log) -> dict:
    env_path = out / "envinfo.json"
    env = json.loads(env_path.read_text()) if env_path.exists() else {}
    bandwidth = (env.get("copy_bandwidth_gbps") or 0) * 1e9 or copy_bandwidth(device)
    tflops = env.get("matmul_bf16_tflops")
    rows: list = []
    passes = []
    for shape in plan.kernel_shapes:  # a pass per shape: each one's rows are written as soon as it ends
        passes.append((f"logprobs and kl {shape}", lambda s=shape: run_kernels(
            device, shapes=[s], dtypes=plan.kernel_dtypes, repeats=plan.kernel_repeats, progress=log,
            bandwidth=bandwidth)[0]))
    for shape in plan.linear_shapes:
        passes.append((f"linear_logprobs {shape}", lambda s=shape: run_linear(
            device, shapes=[s], dtypes=plan.linear_dtypes, repeats=plan.linear_repeats, progress=log)))
    passes.append(("torch.compile: logprobs and kl", lambda: run_kernels(
        device, shapes=list(plan.kernel_shapes), dtypes=plan.compile_dtypes, repeats=plan.kernel_repeats,
        progress=log, compile=True, only={"compile"}, modes=COMPILE_LOGPROB_MODES, bandwidth=bandwidth)[0]))
    passes.append(("torch.compile: linear_logprobs", lambda: run_linear(
        device, shapes=list(plan.linear_shapes), dtypes=plan.compile_dtypes, repeats=plan.linear_repeats,
        progress=log, compile=True, only={"compile"})))
    for name, measure in passes:
        log(f"-- {name}")
        rows += measure()
        write_tables(out, rows, env, bandwidth, tflops, liger_status(device))
    errors = [r for r in rows if r.median_ms is None and not _expected_gap(r)]
    fused = [r for r in rows if r.method.startswith("portarl:") and r.median_ms is not None]
    line = f"{len(rows)} rows ({len(fused)} of portarl's ops timed), liger: {liger_status(device) or 'measured'}"
    broken = [r for r in errors if r.method.startswith("portarl:")]
    result = {"status": "failed" if broken else "ok", "line": line, "rows": len(rows),
              "not_measured": [f"{r.op} {r.method} {r.mode} {r.dtype} N={r.n} V={r.v}: {r.error}" for r in errors][:20]}
    if broken:
        r = broken[0]
        result["line"] = f"{len(broken)} of portarl's kernel timings failed, first: {r.op} {r.method} {r.mode} " \
                         f"{r.dtype} N={r.n} V={r.v}: {r.error}"
    return result


def _expected_gap(row) -> bool:
    """A method that cannot do what the row asks (Liger has no entropy output)."""
    return row.method == "liger" and "entropy" in row.mode


def linear_flops(row) -> float:
    """The lm head's matmul work of a linear_logprobs row: 2 N H V forward; the backward
    adds the hidden and the weight gradients (twice that again)."""
    fwd = 2 * row.n * row.h * row.v
    return fwd if row.mode == "fwd" else 3 * fwd


def write_tables(out, rows, env, bandwidth, tflops, liger) -> None:
    from portarl.bench.hardware.check import write_json

    data = []
    for r in rows:
        d = dataclasses.asdict(r)
        if r.op == "linear_logprobs" and r.median_ms:
            d["tflops"] = linear_flops(r) / (r.median_ms / 1e3) / 1e12
            d["frac_matmul"] = d["tflops"] / tflops if tflops else None
        data.append(d)
    write_json(out / "kernels.json", {"device": env.get("device_name"), "copy_bandwidth_gbps": bandwidth / 1e9,
                                      "matmul_bf16_tflops": tflops, "liger": liger or "measured", "rows": data})
    (out / "kernels.md").write_text(markdown(data, env, bandwidth, tflops, liger))


def markdown(rows: list[dict], env: dict, bandwidth: float, tflops, liger) -> str:
    lines = [f"# Kernels on {env.get('device_name', '?')}", "",
             f"Measured copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write), bf16 matmul "
             + (f"{tflops:.1f} TFLOP/s" if tflops else "not measured")
             + f"; torch {env.get('torch', '?')}, triton {env.get('triton', '?')}; Liger: {liger or 'measured'}.", "",
             "Memory-bound ops (log-probs with entropy, KL): GB/s = the least bytes the op must move / time; "
             "'of copy' = that against the copy bandwidth. The linear op: TFLOP/s of its matmuls against the "
             "measured bf16 matmul.", "",
             "| op | shape | dtype | mode | method | median ms | peak extra MiB | GB/s | of copy | TFLOP/s | of matmul |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"{r['n']}x{r['h']}x{r['v']}" if r["op"] == "linear_logprobs" else (
            f"{r['n']}x{r['v']}" if r["op"] == "logprobs" else f"{r['n']}")
        if r["median_ms"] is None:
            lines.append(f"| {r['op']} | {shape} | {r['dtype']} | {r['mode']} | {r['method']} | - | - | - | - | - | "
                         f"{(r['error'] or '')[:80]} |")
            continue
        lines.append(
            f"| {r['op']} | {shape} | {r['dtype']} | {r['mode']} | {r['method']} | {r['median_ms']:.3f} | "
            f"{_num(r['peak_extra_mb'], '.0f')} | {_num(r.get('gbps'), '.0f')} | {_pct(r.get('frac_copy_bw'))} | "
            f"{_num(r.get('tflops'), '.1f')} | {_pct(r.get('frac_matmul'))} |")
    return "\n".join(lines) + "\n"


def _num(x, spec: str) -> str:
    return "-" if x is None or x < 0 else format(x, spec)


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"
