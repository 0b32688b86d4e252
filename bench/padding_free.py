"""Padding-free against padded micro-batches on one real rollout: the same sampled batch
(mixed completion lengths) scored and trained from the same weights both ways, in one
process, rounds alternating the order; writes ``<out>.json`` and ``<out>.md``.

    PYTHONPATH=. python bench/padding_free.py --config bench/configs/smollm2-readme.yaml \\
        --set train.prompts_per_step=8 --rounds 2 --threads 1 --out bench/results/padding-free-cpu-smollm2.json

Per variant and round: process CPU seconds of the scoring phase (rewards, reference
log-probs) and of the update (the training forward and backward, checkpointing's
recompute, the optimizer step), and, for one pass over the batch (what each forward
sees): the real tokens (prompt + completion), the tokens the padded micro-batches compute
(rows x their own width) and the tokens the packed rows compute (real + row tails). The
loss and grad norm of both variants are reported too: the same numbers within fp32
rounding, so the time is for the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], dest="sets")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import portarl.trainer.phases.update as update
    from portarl.trainer import GRPOTrainer, TrainConfig, build_from_config
    from portarl.trainer.phases.micro_batches import micro_batches
    from portarl.trainer.phases.rollout import run_rollout
    from portarl.trainer.phases.scoring import score

    load_start = _load()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig.load(args.config, [*args.sets, f"output_dir={tmp}"])
        model, tokenizer, examples = build_from_config(cfg)
        trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
        layout = trainer.padding_free
        if layout is None:
            raise SystemExit("the model does not pack (train.padding_free resolved to padded): nothing to compare")
        started = time.process_time()
        phase = run_rollout(trainer, 1)
        rollout_s = time.process_time() - started
        lengths = [len(c) for c in phase.rollout.completion_ids]
        snapshot = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        if trainer.uses_reference():
            trainer.ref_model = trainer.make_reference()  # the initial model, shared by every run

        tokens: dict = {}

        def counted(tr, batch):
            parts = micro_batches(tr, batch)
            tokens["real"] = sum(int(p.attention_mask.sum()) for _, p in parts)
            tokens["padded"] = sum(p.input_ids.numel() for _, p in parts)
            tokens["packed"] = sum(p.packed.input_ids.numel() for _, p in parts if p.packed is not None)
            tokens["rows"] = [list(p.packed.input_ids.shape) for _, p in parts if p.packed is not None]
            return parts

        update.micro_batches = counted
        runs: list[dict] = []
        for r in range(args.rounds):
            order = [("padded", None), ("padding-free", layout)]
            for name, value in (order if r % 2 == 0 else order[::-1]):
                trainer.model.load_state_dict(snapshot)
                trainer.optimizer.state.clear()
                trainer.precision.zero_grad()
                trainer.padding_free = value
                metrics: dict = {}
                t0 = time.process_time()
                scored = score(trainer, phase, metrics)
                t1 = time.process_time()
                update.run_update(trainer, scored, metrics, [])
                t2 = time.process_time()
                runs.append({"variant": name, "round": r, "scoring_cpu_s": t1 - t0, "update_cpu_s": t2 - t1,
                             "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], **tokens})
                print(json.dumps(runs[-1]), flush=True)
    load_end = _load()
    summary = {}
    for name in ("padded", "padding-free"):
        rows = [x for x in runs if x["variant"] == name]
        summary[name] = {k: statistics.median(x[k] for x in rows) for k in ("scoring_cpu_s", "update_cpu_s")}
        summary[name]["step_cpu_s"] = summary[name]["scoring_cpu_s"] + summary[name]["update_cpu_s"]
        summary[name].update({k: rows[0][k] for k in ("real", "padded", "packed", "loss", "grad_norm")})
    command = "PYTHONPATH=. python bench/padding_free.py --config " + args.config + "".join(
        f" --set {s}" for s in args.sets) + f" --rounds {args.rounds} --threads {args.threads} --out {args.out}"
    record = {"command": command, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "load_average_start": load_start, "load_average_end": load_end, "torch": torch.__version__,
              "layout": {"kind": layout.kind, "linear": layout.linear, "attention": layout.attention},
              "sequences": len(lengths), "completion_lengths": {"min": min(lengths), "mean": sum(lengths) / len(lengths),
                                                                "max": max(lengths)},
              "rollout_cpu_s": rollout_s, "runs": runs, "summary": summary}
    out = Path(args.out)
    out.write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text(_markdown(record) + "\n")
    print(_markdown(record))


def _markdown(rec: dict) -> str:
    s, c = rec["summary"], rec["completion_lengths"]
    pad, free = s["padded"], s["padding-free"]
    lines = [
        "# Padding-free vs padded micro-batches (CPU)", "",
        f"Command: `{rec['command']}`  ",
        f"Machine: {rec['machine']}; torch {rec['torch']}; load average (1/5/15 min) {rec['load_average_start']} at "
        f"start, {rec['load_average_end']} at the end.  ",
        f"Work: one sampled batch of {rec['sequences']} sequences (completion lengths {c['min']}-{c['max']}, mean "
        f"{c['mean']:.1f} tokens), scored and trained from the same weights both ways; layout "
        f"`{rec['layout']['kind']}` (linear {rec['layout']['linear']} and attention {rec['layout']['attention']} "
        "multiply-adds per token and per key).", "",
        "Tokens per pass over the batch (every forward sees these):", "",
        "| real | padded micro-batches compute | packed rows compute | padded / real | packed / real |",
        "|---|---|---|---|---|",
        f"| {pad['real']} | {pad['padded']} | {free['packed']} | {pad['padded'] / pad['real']:.2f} | "
        f"{free['packed'] / pad['real']:.2f} |", "",
        "Process CPU seconds per step, median over rounds:", "",
        "| variant | scoring | update | scoring + update | loss | grad norm |", "|---|---|---|---|---|---|",
    ]
    for name in ("padded", "padding-free"):
        v = s[name]
        lines.append(f"| {name} | {v['scoring_cpu_s']:.2f} | {v['update_cpu_s']:.2f} | {v['step_cpu_s']:.2f} | "
                     f"{v['loss']:.6g} | {v['grad_norm']:.6g} |")
    lines += ["", f"**padding-free / padded: update {free['update_cpu_s'] / pad['update_cpu_s']:.2f}x, scoring "
              f"{free['scoring_cpu_s'] / pad['scoring_cpu_s']:.2f}x, scoring + update "
              f"{free['step_cpu_s'] / pad['step_cpu_s']:.2f}x.**", "",
              "Rounds (process CPU s, scoring / update): " + ", ".join(
                  f"{x['variant']} {x['scoring_cpu_s']:.1f} / {x['update_cpu_s']:.1f}" for x in rec["runs"])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
