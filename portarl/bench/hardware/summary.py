"""``summary.md``: what a person reads first after a hardware check.

The verdict and each stage's one line on top; then the figures a reader looks for (the
rooflines, the fused ops against eager / compile / Liger at the RL shapes, the training
runs, the hardware tests and their skip reasons) and the commands that read the other files.
Rewritten after every stage, so a check stopped midway still leaves a summary of what ran.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

HEADLINE_MODES = ("fwd+entropy", "fwd+bwd+entropy")


def summary_markdown(plan, out: Path, outcomes: dict, seconds: float) -> str:
    env = _read(out / "envinfo.json") or {}
    failed = [n for n, o in outcomes.items() if o["status"] not in ("ok", "n/a")]
    verdict = "PASSED" if not failed else f"FAILED ({', '.join(failed)})"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# portarl hardware-check: {env.get('device_name', plan.device)}", "",
             f"**{verdict}** in {seconds:.0f} s, {when}; `--device {plan.device}`"
             + (" `--quick`" if plan.quick else "") + f"; portarl {env.get('portarl', '?')}"
             + (f", package files sha256 {env['portarl_tree_sha256']}" if env.get("portarl_tree_sha256") else "")
             + _commit(), "",
             "| stage | outcome | seconds | |", "|---|---|---|---|"]
    for name, o in outcomes.items():
        lines.append(f"| {name} | {o['status']} | {o.get('seconds', 0):.0f} | {_cell(o['line'])} |")
    lines += ["", *_environment(env), *_parity(outcomes.get("parity")), *_kernels(out),
              *_training(outcomes.get("training")), *_step(outcomes.get("step")), *_tests(outcomes.get("hardware-tests")),
              *_next(plan)]
    return "\n".join(lines) + "\n"


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f" (git HEAD {sha}: a copied tree's .git may be stale; the sha256 is what ran)" if sha else ""


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")[:300]


def _environment(env: dict) -> list[str]:
    if not env:
        return []
    mem = env.get("memory", {})
    return ["## Environment", "",
            f"- device: {env.get('device_name')} ({env.get('device')}), {mem.get('total_gib', 0):.0f} GiB"
            + (f", {mem['multiprocessors']} SMs, compute capability {mem['compute_capability']}"
               if "multiprocessors" in mem else ""),
            f"- versions: python {env.get('python')}, torch {env.get('torch')}, triton {env.get('triton')}, "
            f"CUDA {env.get('cuda')}, driver {env.get('nvidia_driver')}, torch_npu {env.get('torch_npu')}, "
            f"CANN {env.get('cann')}",
            f"- measured copy bandwidth: **{env.get('copy_bandwidth_gbps', 0):.0f} GB/s** (read + write); "
            f"bf16 matmul: **{env.get('matmul_bf16_tflops', 0):.1f} TFLOP/s** ({env.get('matmul_shape')})", ""]


def _parity(o: dict | None) -> list[str]:
    if not o:
        return []
    lines = ["## Parity (`parity.json`)", "", f"- {o['line']}"]
    lines += [f"  - {f}" for f in o.get("failed", [])]
    return lines + [""]


def _kernels(out: Path) -> list[str]:
    data = _read(out / "kernels.json")
    if not data:
        return []
    rows = data["rows"]
    lines = ["## Kernels (`kernels.json`, `kernels.md`)", "",
             f"Log-probs with entropy, median ms (share of the {data['copy_bandwidth_gbps']:.0f} GB/s copy "
             "bandwidth; peak extra MiB). Liger has no entropy output: its column is the log-probs alone.", "",
             "| shape | dtype | mode | portarl | eager | torch.compile | Liger (no entropy) |", "|---|---|---|---|---|---|---|"]
    native = next((r["method"] for r in rows if r["method"] in ("portarl:cuda", "portarl:npu")), "portarl:reference")
    keys = sorted({(r["n"], r["v"], r["dtype"]) for r in rows if r["op"] == "logprobs"})
    for n, v, dtype in keys:
        for mode in HEADLINE_MODES:
            def cell(method, m=mode):
                r = next((r for r in rows if r["op"] == "logprobs" and (r["n"], r["v"], r["dtype"]) == (n, v, dtype)
                          and r["mode"] == m and r["method"] == method), None)
                if r is None:
                    return "-"
                if r["median_ms"] is None:
                    return f"({_cell((r['error'] or '')[:40])})"
                share = f", {r['frac_copy_bw']:.0%}" if r.get("frac_copy_bw") is not None else ""
                peak = r.get("peak_extra_mb")  # -1: not measured (an NPU's allocator)
                return f"{r['median_ms']:.2f} ms{share}" + (f"; {peak:.0f} MiB" if peak is not None and peak >= 0 else "")
            liger = cell("liger", mode.replace("+entropy", ""))
            lines.append(f"| {n}x{v} | {dtype} | {mode} | {cell(native)} | {cell('eager')} | {cell('compile')} | {liger} |")
    linear = [r for r in rows if r["op"] == "linear_logprobs"]
    if linear:
        lines += ["", "Fused linear log-probs (N x H x V), median ms (TFLOP/s; peak extra MiB):", "",
                  "| shape | dtype | mode | method | ms | TFLOP/s | peak MiB |", "|---|---|---|---|---|---|---|"]
        for r in linear:
            ms = f"{r['median_ms']:.2f}" if r["median_ms"] is not None else f"({_cell((r['error'] or '')[:60])})"
            tf = f"{r['tflops']:.0f}" if r.get("tflops") else "-"
            mib = f"{r['peak_extra_mb']:.0f}" if (r.get("peak_extra_mb") or -1) >= 0 else "-"
            lines.append(f"| {r['n']}x{r['h']}x{r['v']} | {r['dtype']} | {r['mode']} | {r['method']} | {ms} | {tf} | {mib} |")
    return lines + [""]


def _training(o: dict | None) -> list[str]:
    if not o or "runs" not in o:
        return []
    lines = ["## Training (`stability.tar`)", "", f"Attention: {o.get('attention')}.", "",
             "| run | steps | reward first -> last fifth | last loss | max grad norm | skipped | median step s | problem |",
             "|---|---|---|---|---|---|---|---|"]
    for r in o["runs"]:
        reward = (f"{r['reward_first']:.3f} -> {r['reward_last']:.3f}" if r.get("reward_first") is not None else "-")
        loss = f"{r['loss_last']:.4f}" if r.get("loss_last") is not None else "-"
        gn = f"{r['grad_norm_max']:.2f}" if r.get("grad_norm_max") is not None else "-"
        st = f"{r['step_s_median']:.2f}" if r.get("step_s_median") is not None else "-"
        lines.append(f"| {r['label']} | {r['steps_done']}/{r['steps_asked']} | {reward} | {loss} | {gn} | "
                     f"{r.get('skipped_steps', '-')} | {st} | {_cell(r['problem'] or '')} |")
    return lines + [""]


def _step(o: dict | None) -> list[str]:
    if not o or "shapes" not in o:
        return []
    s = o["settings"]
    lines = ["## A whole GRPO step against the plain one (`check.json`: step)", "",
             f"`{o['command']}`: {s['prompts']} prompts x {s['group']} samples, {s['new_tokens']} new tokens; the plain "
             "step's update: full logits, fp32 log_softmax, gather, on the same batches.", "",
             "| shape | rollout s | portarl update s | plain update s | step speed-up | tokens/s portarl / plain "
             "| update peak MiB portarl / plain |", "|---|---|---|---|---|---|---|"]
    for r in o["shapes"]:
        p, q = r["portarl"], r["plain"]
        peak = (f"{p['update_peak_mib']:.0f} / {q['update_peak_mib']:.0f}" if p.get("update_peak_mib") is not None
                else "-")
        lines.append(f"| {r['shape']} | {r['rollout_s']:.2f} | {p['update_s']:.2f} | {q['update_s']:.2f} | "
                     f"{r['step_speedup']:.2f}x | {p['tokens_per_s']:.0f} / {q['tokens_per_s']:.0f} | {peak} |")
    return lines + [""]


def _tests(o: dict | None) -> list[str]:
    if not o:
        return []
    lines = ["## Hardware-marked tests", "", f"- {o['line']}"]
    for reason, count in sorted(o.get("skipped", {}).items(), key=lambda kv: -kv[1])[:10]:
        lines.append(f"  - skipped {count}: {_cell(reason)}")
    lines += [f"  - failed: {_cell(f)}" for f in o.get("failures", [])]
    return lines + [""]


def _next(plan) -> list[str]:
    return ["## Reading these files at home", "",
            "```bash",
            "portarl parity compare parity.json OTHER/parity.json      # against another device's report",
            "portarl bench stability --replay-from stability.tar --runs cpu:bf16:npu-emulated,cpu:bf16 \\",
            "    --out runs/replay                                     # the CPU emulation on the device's rollouts",
            "portarl bench stability compare stability.tar runs/replay # one report, with the mean relative loss gap",
            "```"]
