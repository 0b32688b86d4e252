"""Partial rollouts across a weight update: keep the KV cache computed under the old weights
(PipelineRL) or re-prefill prompt + tokens under the new ones (verl; portarl's choice)?
Measured on the tiny model: how far each one's behaviour log-probs of the tokens sampled
after the update are from the trainer's own (a full forward under the new weights).

    PYTHONPATH=. python bench/partial_kv_mismatch.py --out bench/results/partial-kv-mismatch-cpu.json

The old weights are the built-in tiny model's; the new ones one AdamW step (lr 1e-3, the
demo's) on the log-likelihood of a batch, an update of the size a sequence in flight meets.
Each of 32 sequences has k tokens under the old weights, then m more, and the log-probs of
those m are computed three ways under the new weights: (a) continuing from the KV cache of prompt + k tokens computed
under the old weights (PipelineRL's in-flight update), (b) re-prefilling prompt + k tokens
under the new weights then decoding (verl's, portarl's), (c) the trainer's full forward.
Reported: mean and max |a - c| and |b - c| per token, and the same for the old weights'
log-probs (what an engine without any update would give), for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def _logprobs_after(model, prefix: torch.Tensor, tail: torch.Tensor, cache=None) -> torch.Tensor:
    """log p(tail | prefix) per token, [rows, m], through the model's forward with a KV cache:
    ``cache`` of the prefix when given (computed elsewhere), else prefilled here."""
    from portarl.rollout.hf import _cache_argument, _cache_of

    name = _cache_argument(model)
    if cache is None:
        cache = _cache_of(model(input_ids=prefix, use_cache=True))
    out = model(input_ids=tail, use_cache=True, **{name: cache})
    # position i of the tail predicts tail[i + 1]
    logits = out.logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tail[:, 1:, None]).squeeze(-1)


def measure(k: int = 12, m: int = 12, rows: int = 32, seed: int = 0) -> dict:
    import copy

    from portarl.assets.models import build_tiny

    torch.manual_seed(seed)
    old, _ = build_tiny(seed=0)
    old.eval()
    new = copy.deepcopy(old)
    opt = torch.optim.AdamW(new.parameters(), lr=1e-3)  # one optimizer step on a sampled batch's log-likelihood
    ids = torch.randint(3, 60, (rows, 8 + k + m))
    loss = -torch.log_softmax(new(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    opt.step()
    new.eval()
    prefix, tail = ids[:, : 8 + k], ids[:, 8 + k - 1:]  # the tail starts with the prefix's last token
    with torch.no_grad():
        full_new = torch.log_softmax(new(input_ids=ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        trainer = full_new[:, 8 + k - 1:]  # the trainer's log-probs of the m tokens after the update
        from portarl.rollout.hf import _cache_of

        kept = _logprobs_after(new, prefix[:, :-1], tail, cache=_cache_of(old(input_ids=prefix[:, :-1], use_cache=True)))
        refill = _logprobs_after(new, prefix[:, :-1], tail)
        stale = _logprobs_after(old, prefix[:, :-1], tail)

    def gap(x):
        d = (x - trainer).abs()
        return {"mean": float(d.mean()), "max": float(d.max())}

    return {"k_old_tokens": k, "m_new_tokens": m, "rows": rows, "keep_kv_cache": gap(kept),
            "re_prefill": gap(refill), "old_weights_no_update": gap(stale),
            "update_kl_mean": float((trainer - stale).abs().mean())}


def markdown(r: dict) -> str:
    return "\n".join([
        "# Partial rollouts across a weight update: keep the KV cache or re-prefill (CPU, tiny model)", "",
        f"{r['rows']} sequences, {r['k_old_tokens']} tokens under the old weights, then {r['m_new_tokens']} under the "
        "new ones (one AdamW step, lr 1e-3); |behaviour log-prob - trainer's| per token of the m tokens:", "",
        "| way | mean | max |", "|---|---|---|",
        f"| keep the KV cache of the old weights (PipelineRL) | {r['keep_kv_cache']['mean']:.2e} | {r['keep_kv_cache']['max']:.2e} |",
        f"| re-prefill prompt + tokens under the new weights (verl, portarl) | {r['re_prefill']['mean']:.2e} | {r['re_prefill']['max']:.2e} |",
        f"| no update: the old weights' log-probs (scale) | {r['old_weights_no_update']['mean']:.2e} | {r['old_weights_no_update']['max']:.2e} |",
        "", "Command: `PYTHONPATH=. python bench/partial_kv_mismatch.py --out bench/results/partial-kv-mismatch-cpu.json`.",
        ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = measure()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
