"""PPO with a value model and on-policy distillation on the built-in task, each against
GRPO on the same steps (docs/ppo-and-distillation.md quotes what this prints).

    python examples/ppo_and_distill.py gae --out runs/gae-vs-grpo
    python examples/ppo_and_distill.py distill --out runs/distill

Every run is ``portarl train`` on the demo's model and data (the tiny Qwen2 from its
config, single-digit addition, the demo's 40-step supervised warm-up and learning rate),
one torch thread, scored greedily on all 100 problems (``examples/data/demo_eval.jsonl``:
single-digit addition has no others, so the set is the task, not a held-out split) every
10 steps:

- ``gae``: GRPO (the demo) and PPO (``loss.advantage_estimator: gae``, the value model
  warmed up for 5 steps), 60 steps each; the reward of the first and last 10 steps and the
  accuracy at the end.
- ``distill``: a teacher (the demo trained for 200 GRPO steps), then students from a fresh
  model: GRPO with the teacher's reverse KL beside the rewards (``loss.distill``) against
  GRPO alone, from the demo's 40-step warm-up (the step each first reaches the teacher's
  accuracy; GRPO alone from there is the teacher's own run) and from a 10-step warm-up
  (where the rewards are sparse: the accuracy after 150 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EVAL = HERE / "data" / "demo_eval.jsonl"
DEMO = ["optim.lr=1e-3", f"eval.data={EVAL}", "eval.every=10", "eval.greedy=true", "logging.progress=false",
        "logging.tensorboard=false", "logging.plot=false", "checkpoint.every=1000"]


def train(out: Path, *sets: str) -> list[dict]:
    cmd = [sys.executable, "-m", "portarl", "train", "--output-dir", str(out), "--overwrite"]
    for item in (*DEMO, *sets):
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _mean(rows, key, part):
    values = [r[key] for r in rows if r.get("phase", "grpo") == "grpo" and key in r]
    part = values[:10] if part == "first" else values[-10:]
    return sum(part) / len(part)


def _accuracy(rows) -> list[tuple[int, float]]:
    return [(r["step"], r["eval/reward/mean"]) for r in rows if "eval/reward/mean" in r]


def gae(out: Path) -> dict:
    runs = {"grpo": train(out / "grpo", "train.steps=60"),
            "ppo (gae)": train(out / "ppo", "train.steps=60", "loss.advantage_estimator=gae", "critic.warmup_steps=5",
                               "critic.lr=1e-3")}
    return {name: {"reward_first10": _mean(rows, "reward/mean", "first"),
                   "reward_last10": _mean(rows, "reward/mean", "last"),
                   "accuracy": _accuracy(rows)[-1][1], "accuracy_curve": _accuracy(rows)}
            for name, rows in runs.items()}


def _first_at(curve, target):
    return next((step for step, acc in curve if acc >= target - 1e-9), None)


def distill(out: Path) -> dict:
    teacher_rows = train(out / "teacher", "train.steps=200", "checkpoint.every=200")
    teacher = out / "teacher" / "checkpoints" / "step-000200"
    target = _accuracy(teacher_rows)[-1][1]
    # GRPO alone from the same start is the teacher's own run (same config, seed and thread count):
    # its curve is the teacher's, up to step 200.
    student = train(out / "distill", "train.steps=200", f"loss.distill={{teacher: {teacher}}}")
    weak = {name: train(out / name, "train.steps=150", "train.sft_warmup_steps=10", *sets)
            for name, sets in (("weak-grpo", ()), ("weak-distill", (f"loss.distill={{teacher: {teacher}}}",)))}
    return {
        "teacher_accuracy": target,
        "grpo": {"steps_to_teacher_accuracy": _first_at(_accuracy(teacher_rows), target),
                 "accuracy_curve": _accuracy(teacher_rows)},
        "grpo + distillation": {"steps_to_teacher_accuracy": _first_at(_accuracy(student), target),
                                "accuracy_curve": _accuracy(student)},
        "10-step warm-up": {name: {"accuracy_at_150": _accuracy(rows)[-1][1],
                                   "steps_to_0.2": _first_at(_accuracy(rows), 0.2),
                                   "accuracy_curve": _accuracy(rows)} for name, rows in weak.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", choices=["gae", "distill"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    result = gae(out) if args.which == "gae" else distill(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
