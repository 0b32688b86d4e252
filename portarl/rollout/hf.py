"""The embedded rollout engine: a Hugging Face causal LM sampled with its KV cache.

Batched, prompts left-padded (position ids from the attention mask, as the trainer uses),
temperature / top-k / top-p, ``max_new_tokens``, stop on EOS. Sampling is written out
rather than delegated to ``generate`` because each row needs its own random stream
(Gumbel-max with a per-sample ``torch.Generator``): ``generate`` draws every row from one
global stream, so results would depend on batch composition and a fixed seed per request
would make every sample of a group identical.
"""

from __future__ import annotations

import torch

from portarl import ops
from portarl.rollout.base import RolloutBatch, RolloutEngine, SamplingParams


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def filter_logits(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf outside the top-k / nucleus (top-p) set of each row; z is fp32 [B, V]."""
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


class HFRollout(RolloutEngine):
    name = "hf"

    def __init__(self, model: torch.nn.Module, eos_token_id: int | list[int], pad_token_id: int):
        self.model = model
        #: ``flag -> bool``: whether every process is done (several FSDP ranks decode in
        #: lock step because each forward is collective). Default: this process alone.
        self.finished_everywhere = lambda flag: flag
        #: Stop tokens: eos, or a list (eos and a chat template's end of turn, e.g. <|im_end|>).
        self.stop_token_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]
        self.eos_token_id = self.stop_token_ids[0]
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def generate(self, prompts, seeds, params: SamplingParams) -> RolloutBatch:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        model = self.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        try:
            gens = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
            ids, mask = left_pad(prompts, self.pad_token_id, device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
            next_pos = positions[:, -1:] + 1
            n = len(prompts)
            completions = [[] for _ in range(n)]
            logprobs = [[] for _ in range(n)]
            done = torch.zeros(n, dtype=torch.bool)
            for _ in range(params.max_new_tokens):
                z = logits.float() / params.temperature
                if params.greedy:
                    tokens = z.argmax(-1).cpu()
                else:
                    filtered = filter_logits(z, params.top_k, params.top_p).cpu()
                    u = torch.stack([torch.rand(z.shape[-1], generator=g) for g in gens]).clamp_(1e-20, 1.0)
                    tokens = (filtered - torch.log(-torch.log(u))).argmax(-1)
                lp = ops.logprobs(logits, tokens.to(device), temperature=params.temperature).cpu()
                for i in torch.nonzero(~done).flatten().tolist():
                    completions[i].append(int(tokens[i]))
                    logprobs[i].append(float(lp[i]))
                done |= torch.isin(tokens, torch.tensor(self.stop_token_ids))
                if self.finished_everywhere(bool(done.all())):
                    break
                mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=1)
                out = model(
                    input_ids=tokens.to(device)[:, None], attention_mask=mask, position_ids=next_pos,
                    past_key_values=past, use_cache=True,
                )
                past, logits = out.past_key_values, out.logits[:, -1]
                next_pos = next_pos + 1
            return RolloutBatch([list(p) for p in prompts], completions, logprobs, done.tolist())
        finally:
            model.train(was_training)
