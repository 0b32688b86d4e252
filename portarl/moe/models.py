"""Tiny mixture-of-experts models for CPU tests and demos (no download): a Qwen3-MoE
(``model.path: tiny-qwen3-moe``) and a Qwen2-MoE with a shared expert
(``tiny-qwen2-moe``), with the built-in character tokenizer of ``tiny``.

4 experts, 2 per token, 2 decoder layers of width 64: enough experts that two routers
which differ slightly choose differently, as a real MoE's trainer and rollout engine do.
"""

from __future__ import annotations

import torch

#: ``model.path`` names -> family (also in :data:`portarl.assets.tokenizer.BUILTIN_MODELS`).
BUILTIN_MOES = {"tiny-qwen3-moe": "qwen3_moe", "tiny-qwen2-moe": "qwen2_moe"}


def tiny_moe_config(family: str, vocab_size: int, *, hidden_size: int = 64, layers: int = 2, experts: int = 4,
                    top_k: int = 2, max_positions: int = 256, heads: int = 4, kv_heads: int = 2):
    """``heads`` / ``kv_heads``: ``model.heads`` / ``model.kv_heads`` (head size ``hidden_size //
    heads``; vLLM's CPU attention takes 32 and up, so the vllm engine's tests use 2 / 1)."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, num_experts=experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=hidden_size, norm_topk_prob=True, tie_word_embeddings=True,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(head_dim=hidden_size // heads, **common)
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(shared_expert_intermediate_size=hidden_size, **common)
    raise ValueError(f"unknown mixture-of-experts family {family!r}: use one of {sorted(BUILTIN_MOES.values())}")


def build_tiny_moe(name: str, seed: int = 0, *, heads: int = 4, kv_heads: int = 2):
    """``(model, tokenizer)`` for a name of :data:`BUILTIN_MOES`, fp32, weights from ``seed``,
    ``heads`` / ``kv_heads`` attention heads (:func:`tiny_moe_config`).
    The routers start from random weights (transformers initialises them to zero, which
    would make every expert equally likely and the top-k a tie)."""
    if name not in BUILTIN_MOES:
        raise ValueError(f"model.path {name!r} is not a built-in mixture-of-experts model ({', '.join(BUILTIN_MOES)})")
    from transformers import AutoModelForCausalLM

    from portarl.assets.tokenizer import CharTokenizer
    from portarl.moe.routing import routers

    tokenizer = CharTokenizer()
    config = tiny_moe_config(BUILTIN_MOES[name], len(tokenizer), heads=heads, kv_heads=kv_heads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for router in routers(model):
                router.weight.normal_(0.0, 0.5)
    return model, tokenizer
