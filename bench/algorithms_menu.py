"""Learning check of the algorithm menu on the CPU demo: the default loss (ppo_clip), cispo,
sapo and dynamic sampling, same steps, seeds and learning rate; writes
bench/results/algorithms-menu-cpu.{json,md}.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/algorithms_menu.py [--steps 60] [--seeds 0 1 2]

Each run: ``portarl train --set train.steps=S --set optim.lr=1e-3 --set train.seed=K
--set loss.kl_coef=0.001`` plus the variant's settings (the demo's 40 SFT warm-up steps first), with ``eval.data`` = all 100
single-digit additions, greedy, every 10 steps and after the last. Reported per run: the
greedy eval accuracy (eval/reward/math_exact) at the first evaluation (step 10) and the
last (step S), and the training reward/mean and accuracy over the first and last 10 GRPO
steps (under dynamic sampling these are over the informative groups only, so higher by
construction: compare the eval numbers), wall time; dynamic sampling also its mean
generation rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "ppo_clip (default)": [],
    "cispo": ["loss.policy_loss=cispo"],
    "sapo": ["loss.policy_loss=sapo"],
    "dynamic sampling": ["rollout.dynamic_sampling=true"],
    # Tighter settings, for the off-policy check (--variants):
    "cispo ratio_max 1.28": ["loss.policy_loss=cispo", "loss.cispo_ratio_max=1.28"],
    "sapo tau 4/8": ["loss.policy_loss=sapo", "loss.sapo_temperature_pos=4", "loss.sapo_temperature_neg=8"],
}
DEFAULT_VARIANTS = ["ppo_clip (default)", "cispo", "sapo", "dynamic sampling"]


def _mean(rows, key):
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def eval_file(root: Path) -> Path:
    """Every single-digit addition (the demo's whole task), answers included."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "all-additions.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10)))
    return path


def run(name, extra, steps, seed, root: Path, common: list[str]) -> dict:
    out = root / f"{name.split()[0]}-{len(extra)}{'ds' if 'dynamic' in name else ''}seed{seed}"
    cmd = [sys.executable, "-m", "portarl", "train", "--overwrite", "--output-dir", str(out),
           "--set", f"train.steps={steps}", "--set", "optim.lr=1e-3", "--set", f"train.seed={seed}",
           "--set", "logging.progress=false", "--set", "logging.tensorboard=false", "--set", "logging.plot=false",
           "--set", f"eval.data={eval_file(root)}", "--set", "eval.every=10",
           # The demo's default KL (0.001), stated for every variant so the runs differ only in
           # the variant's own settings.
           "--set", "loss.kl_coef=0.001"]
    for item in [*common, *extra]:
        cmd += ["--set", item]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("phase", "grpo") == "grpo"]
    head, tail = rows[:10], rows[-10:]
    evals = [r for r in rows if "eval/reward/math_exact" in r]
    result = {"variant": name, "seed": seed, "steps": steps, "settings": extra, "wall_s": round(wall, 1),
              "eval_acc_first": evals[0]["eval/reward/math_exact"], "eval_acc_last": evals[-1]["eval/reward/math_exact"],
              "eval_steps": [r["step"] for r in evals], "eval_acc": [r["eval/reward/math_exact"] for r in evals],
              "reward_first10": _mean(head, "reward/mean"), "reward_last10": _mean(tail, "reward/mean"),
              "acc_first10": _mean(head, "reward/math_exact"), "acc_last10": _mean(tail, "reward/math_exact")}
    if any("rollout/rounds" in r for r in rows):
        result["rounds_mean"] = _mean(rows, "rollout/rounds")
        result["informative_frac_mean"] = _mean(rows, "rollout/informative_frac")
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--runs", default="/tmp/portarl-algorithms-menu")
    p.add_argument("--out", default="bench/results/algorithms-menu-cpu")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    p.add_argument("--set", dest="common", action="append", default=[],
                   help="an override for every run, e.g. train.mini_batches=4 (off-policy optimizer steps)")
    args = p.parse_args()
    results = []
    for seed in args.seeds:
        for name in args.variants:
            extra = VARIANTS[name]
            results.append(run(name, extra, args.steps, seed, Path(args.runs), args.common))
            print(json.dumps(results[-1]), flush=True)
    Path(args.out + ".json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# Algorithm menu: learning check on the CPU demo ({args.steps} GRPO steps, lr 1e-3)", "",
             "Command: `PYTHONPATH=. OMP_NUM_THREADS=1 python bench/algorithms_menu.py "
             f"--steps {args.steps} --seeds {' '.join(map(str, args.seeds))}"
             + ("" if args.variants == DEFAULT_VARIANTS else " --variants " + " ".join(f"'{v}'" for v in args.variants))
             + "".join(f" --set {c}" for c in args.common) + "` (tiny Qwen2, single-digit addition, "
             "40 SFT warm-up steps, then GRPO; loss.kl_coef=0.001 for every variant). eval: greedy accuracy on all 100 single-digit additions "
             f"(eval.data, every 10 steps; first = step 10, last = step {args.steps}). train reward / accuracy: "
             "means over the first and last 10 GRPO steps (dynamic sampling: over informative groups only).", "",
             "| variant | seed | eval acc step 10 | eval acc last | eval rise | train reward first 10 | last 10 | "
             "train acc first 10 | last 10 | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['variant']} | {r['seed']} | {r['eval_acc_first']:.2f} | {r['eval_acc_last']:.2f} | "
                     f"{r['eval_acc_last'] - r['eval_acc_first']:+.2f} | {r['reward_first10']:.3f} | "
                     f"{r['reward_last10']:.3f} | {r['acc_first10']:.3f} | {r['acc_last10']:.3f} | {r['wall_s']:.0f} |")
    lines += ["", "Mean over seeds:", "",
              "| variant | eval acc step 10 | eval acc last | train reward first 10 | train reward last 10 | rise |",
              "|---|---|---|---|---|---|"]
    for name in args.variants:
        rs = [r for r in results if r["variant"] == name]

        def avg(key):
            return sum(r[key] for r in rs) / len(rs)

        lines.append(f"| {name} | {avg('eval_acc_first'):.3f} | {avg('eval_acc_last'):.3f} | "
                     f"{avg('reward_first10'):.3f} | {avg('reward_last10'):.3f} | "
                     f"{avg('reward_last10') - avg('reward_first10'):+.3f} |")
    ds = [r for r in results if "rounds_mean" in r]
    if ds:
        lines += ["", "Dynamic sampling: mean generation rounds per step "
                  + ", ".join(f"seed {r['seed']}: {r['rounds_mean']:.2f} (informative {r['informative_frac_mean']:.2f})"
                              for r in ds)]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
