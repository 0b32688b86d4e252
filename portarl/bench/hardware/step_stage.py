"""Stage 5: one whole GRPO step of real-size models, portarl's against the plain step
(:mod:`portarl.bench.step_device`): the Qwen2.5-0.5B and 1.5B shapes with random weights,
bf16, the hf engine, 512-token completions on a GPU (the tiny shape, 8 tokens, on the CPU).
Its figures go to ``check.json`` and ``summary.md`` (the folder's files are fixed)."""

from __future__ import annotations


def run(plan, device, out, work, log) -> dict:
    from portarl.bench.step_device import run as run_step

    result = run_step(str(device), list(plan.step_shapes), progress=log, steps=plan.step_steps, warmup=1,
                      new_tokens=plan.step_new_tokens, prompts=plan.step_prompts, group=plan.step_group)
    parts, rows = [], []
    for shape in result["shapes"]:
        m = shape["summary"]
        p, q = m["portarl"], m["plain"]
        parts.append(f"{shape['shape']}: step {p['step_s']:.2f} s vs plain {q['step_s']:.2f} s "
                     f"({m['step_speedup']:.2f}x)")
        rows.append({"shape": shape["shape"], **{k: m[k] for k in ("rollout_s", "scoring_s", "step_speedup",
                                                                   "update_speedup")},
                     "portarl": p, "plain": q,
                     "grad_norms": [(s["grad_norm"], s["plain_grad_norm"]) for s in shape["steps"]]})
    return {"status": "ok", "line": "; ".join(parts), "settings": result["settings"], "shapes": rows,
            "command": result["command"]}
