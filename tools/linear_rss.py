"""Peak RSS of the log-prob part of a GRPO step (old, reference and training log-probs with
backward) for the built-in tiny Qwen2 given a 151,936-token vocabulary.

    PORTARL_MATERIALIZE_LOGITS=1 python tools/linear_rss.py   # before: full-vocabulary logits
    python tools/linear_rss.py                                # after: ops.linear_logprobs
"""

import os
import resource

import torch

from portarl.assets.models import tiny_qwen2
from portarl.trainer.phases.sequences import build_batch, completion_logprobs

torch.manual_seed(0)
model = tiny_qwen2(151936, seed=0)
ref = tiny_qwen2(151936, seed=0)
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 151936, (16,), generator=gen).tolist() for _ in range(8)]
completions = [torch.randint(3, 151936, (128,), generator=gen).tolist() for _ in range(8)]
batch = build_batch(prompts, completions, 0, "cpu")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    old = completion_logprobs(model, batch, temperature=1.0)
    ref_logp = completion_logprobs(ref, batch, temperature=1.0)
logp, ent = completion_logprobs(model, batch, temperature=1.0, with_entropy=True)
((logp - old).exp().mul(batch.mask).sum() + 0.01 * ent.sum() + (logp - ref_logp).pow(2).sum()).backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mode = "materialised logits" if os.environ.get("PORTARL_MATERIALIZE_LOGITS") == "1" else "linear_logprobs"
print(f"{mode}: B=8 x T=128 completion tokens, V=151936: peak RSS {peak / 2**10:.0f} MiB "
      f"({(peak - base) / 2**10:.0f} MiB above the loaded models)")
