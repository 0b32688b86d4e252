"""A/B of the hf engine's generate before and after a change, interleaved in one process so
that the machine's load hits both alike: the demo's tiny model (128 rows) and SmolLM2 (16
rows), 24 new tokens; prints the median seconds of each and whether their samples and
log-probs are bitwise equal.

Usage: ``git show REV:portarl/rollout/hf.py > /tmp/hf_old.py; python bench/ab_hf_generate.py``
(results: bench/results/rollout-ab-2026-11-29.md)."""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import torch

OLD = sys.argv[1] if len(sys.argv) > 1 else "/tmp/hf_old.py"


def main() -> None:
    from portarl.rollout import SamplingParams, request_seeds
    from portarl.rollout import hf as new
    from portarl.trainer.config import TrainConfig
    from portarl.trainer.start.build import build_from_config

    spec = importlib.util.spec_from_file_location("portarl.rollout.hf_old", OLD)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    torch.set_num_threads(1)
    for name, config, rows, rounds in (("tiny", None, 128, 12), ("smollm2", "examples/smollm2-arith.yaml", 16, 6)):
        model, tok = build_from_config(TrainConfig.load(config, []))[:2]
        prompts = [tok.encode(f"12+{i}=") for i in range(rows)]
        seeds = request_seeds(0, 1, rows, 1)
        params = SamplingParams(max_new_tokens=24, temperature=0.7)
        engines = {k: m.HFRollout(model, tok.eos_token_id, tok.pad_token_id) for k, m in (("before", old), ("after", new))}
        times, outs = {"before": [], "after": []}, {}
        for r in range(rounds):
            for k in ("before", "after") if r % 2 == 0 else ("after", "before"):
                started = time.perf_counter()
                outs[k] = engines[k].generate(prompts, seeds, params)
                times[k].append(time.perf_counter() - started)
        same = (outs["before"].completion_ids == outs["after"].completion_ids
                and outs["before"].logprobs == outs["after"].logprobs)
        print(name, {k: round(statistics.median(v[1:]), 4) for k, v in times.items()},
              "bitwise same samples and log-probs:", same)


if __name__ == "__main__":
    main()
