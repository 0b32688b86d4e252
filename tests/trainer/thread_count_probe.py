"""``python thread_count_probe.py THREADS``: the built-in tiny model's samples and log-probs
(16 prompts x 4 samples, 16 new tokens, fp32, the engine's default lean decode) with
``torch.set_num_threads(THREADS)``, as JSON on stdout. A process of its own per thread count:
torch's intra-op pool is sized once per process (test_thread_count.py)."""

from __future__ import annotations

import json
import sys

import torch


def main(threads: int) -> dict:
    torch.set_num_threads(threads)
    from portarl.assets.data import arithmetic_examples
    from portarl.assets.models import build_tiny
    from portarl.rollout import HFRollout, SamplingParams, request_seeds

    model, tok = build_tiny(seed=0)
    prompts = [tok.encode(ex.prompt) for ex in arithmetic_examples(16, seed=0)]
    engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id)
    batch = engine.generate([p for p in prompts for _ in range(4)], request_seeds(0, 1, 16, 4),
                            SamplingParams(max_new_tokens=16))
    return {"threads": torch.get_num_threads(), "path": engine.decode_path, "tokens": batch.completion_ids,
            "logprobs": batch.logprobs}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
