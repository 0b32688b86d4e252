"""Stage 4: GRPO on the device, the way a real run trains, and its stability record.

Two parts, each on the built-in tiny model (built from its config: nothing to download):

- **The stability record**: ``portarl bench stability`` on ``<device>:bf16`` and
  ``<device>:fp16`` (guards on, fp16 with its dynamic loss scale and fp32 master weights),
  with activation checkpointing, padding-free rows, fused AdamW and the best attention the
  device has (:data:`portarl.bench.hardware.plan.TRAINING_FEATURES`, :func:`attention`). The bf16 run
  records its rollouts; the fp16 run replays them, so the two differ by precision alone.
  The run directory travels as ``stability.tar``: at home, ``portarl bench stability
  --replay-from stability.tar --runs cpu:bf16:npu-emulated,cpu:bf16`` trains the CPU
  emulation on the device's own rollouts and compares it with the device's runs.
- **FSDP2 on one device**: ``portarl train`` under torchrun with one rank and
  ``distributed.fsdp_one_rank=true`` (the sharded path: mixed-precision policy over fp32
  masters, a sharded checkpoint) in bf16 with the same features.

A run that stops early, crashes or logs a non-finite loss fails the stage, named.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import torch

from portarl.bench.hardware.plan import TRAINING_FEATURES

DTYPES = ("bf16", "fp16")


def attention(device: torch.device) -> str:
    """``flash_attention_2`` where flash-attn imports on CUDA (padding-free rows then take its
    varlen kernel), else transformers' sdpa (a block-diagonal mask for packed rows)."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def features(device: torch.device) -> list[str]:
    return [*TRAINING_FEATURES, f"model.attn_implementation={attention(device)}", "train.sft_warmup_steps=0"]


def run(plan, device: torch.device, out, work, log) -> dict:
    runs = [_stability(plan, device, out, work, log), _fsdp_one_rank(plan, device, work, log)]
    runs = [r for group in runs for r in group]
    bad = [r for r in runs if r["problem"]]
    line = "; ".join(_short(r) for r in runs)
    result = {"status": "failed" if bad else "ok", "line": line, "runs": runs, "attention": attention(device)}
    if bad:
        result["line"] = f"{bad[0]['label']}: {bad[0]['problem']}"
    return result


def _stability(plan, device, out, work, log) -> list[dict]:
    from portarl.bench.stability import run_stability
    from portarl.bench.stability.archive import pack_record
    from portarl.bench.stability.runs import RunSpec

    specs = [RunSpec(plan.device, dtype) for dtype in DTYPES]
    directory = work / "stability"
    log(f"stability: {', '.join(s.label for s in specs)}, {plan.training_steps} steps, "
        f"{' '.join(features(device))}")
    analysis, report = run_stability(specs, steps=plan.training_steps, overrides=features(device),
                                     out_dir=directory, replay=True, progress=log)
    pack_record(directory, out / "stability.tar")
    log(f"stability report: {report}; record: {out / 'stability.tar'}")
    rows = []
    for spec in specs:
        rows.append(summarise(spec.label, directory / "runs" / spec.slug, plan.training_steps))
    return rows


def _fsdp_one_rank(plan, device, work, log) -> list[dict]:
    from portarl.runtime.distributed import local_launcher

    run_dir = work / "fsdp-one-rank"
    cmd = [*local_launcher(1), "-m", "portarl", "train", "--device", plan.device, "--steps", str(plan.fsdp_steps),
           "--output-dir", str(run_dir), "--overwrite", "--set", "distributed.fsdp_one_rank=true",
           "--set", "precision.dtype=bf16", *[x for f in features(device) for x in ("--set", f)]]
    log("$ " + " ".join(cmd))
    env = dict(os.environ, PORTARL_SUPERVISE="0")  # the stage's own time limit is the supervisor here
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines()[-25:]:
        log(line)
    row = summarise(f"{plan.device}:bf16 FSDP2 one rank", run_dir, plan.fsdp_steps)
    if proc.returncode != 0 and not row["problem"]:
        row["problem"] = f"portarl train exited {proc.returncode}"
    if not row["problem"] and "checkpoint saved (DCP" not in proc.stdout:
        row["problem"] = "no sharded (DCP) checkpoint was written: the run did not take the FSDP2 path"
    return [row]


def summarise(label: str, run_dir: Path, steps: int) -> dict:
    """What a person wants from a short run: did it finish, stay finite, learn?"""
    rows = []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        rows = [r for r in rows if r.get("phase", "grpo") == "grpo"]
    info = {}
    info_path = run_dir / "run.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
    out = {"label": label, "steps_asked": steps, "steps_done": len(rows), "problem": None}
    if info.get("crashed"):
        out["problem"] = f"crashed: {info['crashed']}"
    elif len(rows) < steps:
        stopped = info.get("stopped") or "no reason recorded"
        out["problem"] = f"stopped at step {len(rows)} of {steps}: {stopped}"
    losses = [r.get("loss") for r in rows]
    bad = [r["step"] for r, v in zip(rows, losses) if not isinstance(v, (int, float)) or not math.isfinite(v)]
    if bad and not out["problem"]:
        out["problem"] = f"non-finite loss at step {bad[0]} ({len(bad)} steps)"
    if rows:
        first, last = rows[: max(1, len(rows) // 5)], rows[-max(1, len(rows) // 5):]
        out["reward_first"] = _mean(first, "reward/mean")
        out["reward_last"] = _mean(last, "reward/mean")
        out["loss_last"] = _mean(last, "loss")
        out["grad_norm_max"] = max((r.get("grad_norm") or 0.0) for r in rows)
        out["skipped_steps"] = int(rows[-1].get("guard/skipped_total") or 0)
        out["step_s_median"] = sorted(r.get("time/step_s") or 0.0 for r in rows)[len(rows) // 2]
        scales = [r.get("precision/loss_scale") for r in rows if r.get("precision/loss_scale")]
        if scales:
            out["loss_scale_last"] = scales[-1]
    return out


def _mean(rows, key):
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def _short(r: dict) -> str:
    if r["problem"]:
        return f"{r['label']}: {r['problem']}"
    return (f"{r['label']}: {r['steps_done']} steps, reward {r['reward_first']:.3f} -> {r['reward_last']:.3f}, "
            f"{r['skipped_steps']} skipped")
