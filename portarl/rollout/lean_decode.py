"""A lean decode step for Llama-family causal LMs: one new token per row, into a
preallocated KV cache, through the model's own modules.

Why: a Hugging Face forward for one token per row spends about 1.3 ms per call on a CPU
whatever the batch (building the attention mask, cache bookkeeping, output dataclasses,
config lookups): 60% of a decode step of a small model, and on a GPU the same Python runs
while the device waits. Its ``DynamicCache`` also grows by ``torch.cat``, copying the whole
cache again for every token. Here the step is the decoder layer's arithmetic and nothing
else, and the cache is written in place.

Faithful by construction: it calls the model's own modules (embeddings, RMSNorms, q/k/v/o
projections, so LoRA adapters injected by peft apply; the rotary embedding module, so every
RoPE scaling variant; the MLP) in the order of the Hugging Face forward, with the same
rotary arithmetic and ``scaled_dot_product_attention`` with the same scale and padding mask
(on the CPU in fp32 that attention written out, :func:`one_row_attention`, so that a run's
samples do not depend on the thread count).
``tests/trainer/test_lean_decode.py`` holds its logits to the Hugging Face forward for each
supported architecture, and the engine's samples to those of the Hugging Face path.

Used only where that holds (:func:`unsupported_reason`, else the engine keeps the Hugging
Face forward): the classes in :data:`SUPPORTED`, ``sdpa`` attention, no sliding window
shorter than the sequence, parameters not sharded by FSDP2 (its per-layer all-gather hooks
run only when a whole layer is called).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portarl.runtime.distributed import has_sharded_params

#: Architectures whose decoder layer is: RMSNorm, q/k/v projections (Qwen3: per-head q/k
#: RMSNorm), RoPE, attention, o projection, residual, RMSNorm, MLP, residual.
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a peft wrapper (adapters stay injected in its modules)."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def unsupported_reason(model: torch.nn.Module, total_length: int) -> str | None:
    """Why :class:`LeanDecoder` must not decode ``model`` up to ``total_length`` positions
    (prompt width + new tokens), or None when it may."""
    hf = _hf_model(model)
    name = type(hf).__name__
    if name not in SUPPORTED:
        return f"{name} is not one of {', '.join(SUPPORTED)}"
    impl = getattr(hf.config, "_attn_implementation", None)
    if impl != "sdpa":
        return f"attention implementation {impl!r} (the lean step reproduces 'sdpa' only)"
    window = getattr(hf.config, "sliding_window", None)
    if window is not None and total_length > window:
        return f"a sliding window of {window} positions, shorter than the {total_length} decoded"
    if has_sharded_params(hf.parameters()):
        return "FSDP2-sharded parameters (all-gathered only when a whole layer is called)"
    return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the Hugging Face forward applies it: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _gqa_supported(device: torch.device) -> bool:
    """``enable_gqa`` in ``scaled_dot_product_attention`` (torch >= 2.5) on CPU / CUDA;
    elsewhere (Ascend) the key / value heads are repeated instead, as Hugging Face does."""
    return device.type in ("cpu", "cuda") and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


def one_row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Attention of one query row per sequence, written out: ``softmax(q k^T * scale)`` over
    the ``valid`` positions (``[B, 1, 1, T]`` bool), times the values; query head h reads
    key / value head ``h // (heads / kv_heads)``, as Hugging Face's ``repeat_kv`` pairs them.

    Why (the CPU in fp32): torch's CPU ``scaled_dot_product_attention`` for a single query
    row sums in an order that depends on the thread count (torch 2.13, from 8 cached
    positions on; its prefill over whole rows does not), so one seeded run sampled other
    tokens on 1 and on 2 threads. Two matrix products and a softmax give the same bits for
    any thread count (``tests/trainer/test_thread_count.py``), within the kernel's own error
    of a float64 reference."""
    b, heads, _, dim = q.shape
    kv = keys.shape[1]
    scores = torch.matmul(q.reshape(b, kv, heads // kv, dim), keys.transpose(-1, -2)) * scale
    weights = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    return torch.matmul(weights, values).reshape(b, heads, 1, dim)


class LeanDecoder:
    """Decodes after a Hugging Face prefill: ``past`` (its KV cache, one row per sequence),
    ``mask`` (the prefill's [B, W] attention mask), room for ``steps`` more tokens."""

    def __init__(self, model: torch.nn.Module, past, mask: torch.Tensor, steps: int):
        hf = _hf_model(model)
        self.inner, self.head = hf.model, hf.lm_head
        layers = [_layer_kv(past, i) for i in range(len(self.inner.layers))]
        b, kv, width, dim = layers[0][0].shape
        self.keys, self.values = [], []
        for k, v in layers:
            for store, src in ((self.keys, k), (self.values, v)):
                buf = src.new_empty((b, kv, width + steps, dim))
                buf[:, :, :width] = src
                store.append(buf)
        self.valid = torch.zeros((b, 1, 1, width + steps), dtype=torch.bool, device=mask.device)
        self.valid[:, 0, 0, :width] = mask.bool()
        self.t = width
        self.gqa = _gqa_supported(mask.device)
        # fp32 on the CPU: attention that sums in the same order for any thread count
        # (one_row_attention); elsewhere torch's kernel (bf16 / fp16 scores would round).
        self.written_out = mask.device.type == "cpu" and layers[0][0].dtype == torch.float32

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] after feeding ``tokens`` [B, 1] at ``positions`` [B, 1]."""
        inner, t = self.inner, self.t
        if t >= self.valid.shape[-1]:
            raise RuntimeError(f"LeanDecoder: no room for position {t} (made for {self.valid.shape[-1]})")
        b = tokens.shape[0]
        x = inner.embed_tokens(tokens)
        cos, sin = inner.rotary_emb(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        self.valid[:, :, :, t] = True
        mask = self.valid[..., : t + 1]
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, 1, -1, attn.head_dim)
            k = attn.k_proj(h).view(b, 1, -1, attn.head_dim)
            v = attn.v_proj(h).view(b, 1, -1, attn.head_dim).transpose(1, 2)
            if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
            self.keys[i][:, :, t] = k[:, :, 0]
            self.values[i][:, :, t] = v[:, :, 0]
            keys, values = self.keys[i][:, :, : t + 1], self.values[i][:, :, : t + 1]
            if self.written_out:
                out = one_row_attention(q, keys, values, mask, attn.scaling)
            else:
                out = self._sdpa(q, keys, values, mask, attn.scaling)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(b, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.t = t + 1
        return self.head(inner.norm(x))[:, -1]

    def keep(self, rows: torch.Tensor) -> None:
        """Decode only ``rows`` (indices into the current rows) from the next step on."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.valid = self.valid[rows]

    def _sdpa(self, q, keys, values, mask, scale):
        groups = q.shape[1] // keys.shape[1]
        extra = {}
        if groups > 1 and self.gqa:
            extra["enable_gqa"] = True
        elif groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, **extra)


def _layer_kv(past, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i``'s (keys, values) [B, kv_heads, W, head_dim] in a Hugging Face cache
    (transformers 5: ``layers[i].keys``; 4.x: ``key_cache[i]``)."""
    layers = getattr(past, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return past.key_cache[i], past.value_cache[i]
