"""Token batches for the trainer and the model forward that gives per-token log-probs.

A batch is laid out exactly as the rollout engine saw it: prompts left-padded to a common
width P, completions after them (right-padded), position ids from the attention mask. The
log-prob of completion token j comes from the logits at position P - 1 + j, so only those
T positions go through the lm head (in fp32 under ``precision.logits="fp32"``), and
:func:`portarl.ops.logprobs` turns them into fp32 log-probs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from portarl import ops
from portarl.emulation import bf16_valued, entropy_in_logits_dtype, matmul_context


@dataclasses.dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T]
    position_ids: torch.Tensor  # [B, P + T]
    labels: torch.Tensor  # [B, T] completion tokens, -100 on padding
    mask: torch.Tensor  # [B, T] bool
    prompt_width: int

    def rows(self, index: slice) -> "TokenBatch":
        return TokenBatch(self.input_ids[index], self.attention_mask[index], self.position_ids[index],
                          self.labels[index], self.mask[index], self.prompt_width)


def build_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device) -> TokenBatch:
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    width_p = max(len(p) for p in prompts)
    width_c = max(1, max(len(c) for c in completions))
    n = len(prompts)
    ids = torch.full((n, width_p + width_c), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width_p + width_c), dtype=torch.long)
    labels = torch.full((n, width_c), -100, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, width_p - len(p) : width_p] = torch.tensor(p, dtype=torch.long)
        attn[i, width_p - len(p) : width_p] = 1
        if c:
            ids[i, width_p : width_p + len(c)] = torch.tensor(c, dtype=torch.long)
            attn[i, width_p : width_p + len(c)] = 1
            labels[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(ids.to(device), attn.to(device), positions.to(device), labels.to(device),
                      (labels != -100).to(device), width_p)


def _is_sharded(model) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, FSDPModule)


def completion_logits(model, batch: TokenBatch, logits_policy: str = "fp32") -> torch.Tensor:
    """Logits [B, T, V] for the completion positions only.

    Under FSDP2 the model's own forward must run (it gathers the sharded parameters), so the
    head is computed there, on the last T + 1 positions (``logits_to_keep``), in the
    parameters' compute dtype; the log-prob op still accumulates in fp32.
    """
    t = batch.labels.shape[1]
    if _is_sharded(model):
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                    logits_to_keep=t + 1)
        return out.logits[:, :-1]
    hidden = model.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
    ).last_hidden_state
    h = hidden[:, batch.prompt_width - 1 : batch.prompt_width - 1 + t]
    head = model.get_output_embeddings()
    if logits_policy == "fp32":
        bias = head.bias.float() if getattr(head, "bias", None) is not None else None
        return F.linear(h.float(), head.weight.float(), bias)
    return head(h)


def completion_logprobs(model, batch: TokenBatch, *, temperature: float, logits_policy: str = "fp32",
                        with_entropy: bool = False, emulate: frozenset = frozenset()):
    """fp32 log-probs [B, T] (0 on padding) and optionally entropy, through portarl.ops.

    ``emulate``: switches of :mod:`portarl.emulation` (NPU numerics emulation); empty for
    portarl's own path.
    """
    with matmul_context(emulate):
        policy = "model" if "bf16_logprobs" in emulate else logits_policy
        logits = completion_logits(model, batch, policy)
    no_upcast = with_entropy and "entropy_no_upcast" in emulate
    out = ops.logprobs(logits, batch.labels, temperature=temperature, return_entropy=with_entropy and not no_upcast)
    logp, entropy = (out if with_entropy and not no_upcast else (out, None))
    if "bf16_logprobs" in emulate and logits.dtype == torch.bfloat16:
        logp = bf16_valued(logp)
    if no_upcast:
        entropy = torch.where(batch.mask, entropy_in_logits_dtype(logits, temperature), 0.0)
    return (logp, entropy) if with_entropy else logp
