"""Shared-prompt rows against unshared padding-free rows on SmolLM2-135M-Instruct (all layers,
fp32, 1 thread): process CPU seconds of the training forward + backward and of the no-grad
scoring forward of one batch (the example's first 4 prompts x G samples, completions of 8 to
MAXC tokens), 3 repetitions alternating the order; prints the tokens each layout feeds and the
largest log-prob difference (bench/results/step-cpu-vs-trl-4x128-share-prompt.md).

    PYTHONPATH=. python bench/share_prompt_smollm2.py        # G=4 MAXC=64 in the environment to change the work
"""
import dataclasses, os, random, time, types

import torch
torch.set_num_threads(1)
from portarl.assets.data import load_examples_for
from portarl.assets.models import build_model
from portarl.assets.tokenizer import as_codec, chat_template_option
from portarl.trainer.config import TrainConfig
from portarl.trainer.phases.packing import resolve_padding_free
from portarl.trainer.phases.sequences import build_batch, completion_logprobs
from portarl.trainer.phases.micro_batches import micro_batches


def _fake_trainer(layout):
    train = types.SimpleNamespace(micro_batch_size=10**6, max_tokens_per_micro_batch=None)
    return types.SimpleNamespace(config=types.SimpleNamespace(train=train), dist=types.SimpleNamespace(enabled=False),
                                 padding_free=layout)

cfg = TrainConfig.load("examples/smollm2-arith.yaml")
model, tok = build_model(cfg.model, dtype=torch.float32)
d = cfg.data
codec = as_codec(tok, chat_template=chat_template_option(d.chat_template), system_prompt=d.system_prompt)
ex = load_examples_for(d)[:4]
text = tok.encode(" ".join(f"{e.answer} plus {e.answer} is" for e in ex * 20), add_special_tokens=False)
rng = random.Random(0)
prompts, comps = [], []
for e in ex:
    p = codec.encode_prompt(e.prompt)
    for _ in range(int(os.environ.get("G", 4))):
        n = rng.randrange(8, int(os.environ.get("MAXC", 64)))
        prompts.append(p); comps.append(text[:n])
batch = build_batch(prompts, comps, tok.pad_token_id or 0, "cpu")
auto = resolve_padding_free(cfg, model)
print("layout", auto, "prompt lens", sorted(set(map(len, prompts))), "completion mean", sum(map(len, comps)) / len(comps))
layouts = {"unshared": dataclasses.replace(auto, share_prompt=False), "shared": auto}
parts = {k: micro_batches(_fake_trainer(v), batch)[0][1] for k, v in layouts.items()}
for k, p in parts.items():
    print(k, "tokens", p.packed.input_ids.numel(), "rows", tuple(p.packed.input_ids.shape), "mask", p.packed.attention_mask is not None)
def fb(part):
    model.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, part, temperature=1.0)
    (logp.sum() / part.mask.sum()).backward()
    return logp.detach()
def score(part):
    with torch.no_grad():
        return completion_logprobs(model, part, temperature=1.0)
res = {k: {"fb": [], "score": []} for k in parts}
out = {}
for r in range(3):
    for k in (list(parts) if r % 2 == 0 else list(parts)[::-1]):
        t = time.process_time(); out[k] = fb(parts[k]); res[k]["fb"].append(time.process_time() - t)
        t = time.process_time(); score(parts[k]); res[k]["score"].append(time.process_time() - t)
print("max |logp shared - unshared|", float((out["shared"] - out["unshared"]).abs().max()))
for k, v in res.items():
    print(k, "fwd+bwd s", [round(x, 3) for x in v["fb"]], "median", sorted(v["fb"])[1], "| scoring s", [round(x, 3) for x in v["score"]], "median", sorted(v["score"])[1])
