"""A tiny Llama GGUF file written with the ``gguf`` package's own writer (byte-level BPE
tokenizer, ChatML template, one tensor Q8_0-quantised): what the GGUF loader is tested on,
so the test suite downloads nothing."""

from __future__ import annotations

import numpy as np

from chat_tiny import CHATML

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64


def _byte_alphabet() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_gguf(path, seed: int = 0) -> dict[str, np.ndarray]:
    """Writes the file; returns the tensors as written (PyTorch layout, float32)."""
    import gguf

    rng = np.random.default_rng(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_alphabet()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.NORMAL] * (vocab - len(specials)))
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHATML)
    written = {"token_embd.weight": rng.normal(0, 0.02, (vocab, HIDDEN)), "output_norm.weight": np.ones(HIDDEN)}
    for i in range(LAYERS):
        kv = HIDDEN // HEADS * KV_HEADS
        written.update({
            f"blk.{i}.attn_norm.weight": np.ones(HIDDEN), f"blk.{i}.ffn_norm.weight": np.ones(HIDDEN),
            f"blk.{i}.attn_q.weight": rng.normal(0, 0.02, (HIDDEN, HIDDEN)),
            f"blk.{i}.attn_k.weight": rng.normal(0, 0.02, (kv, HIDDEN)),
            f"blk.{i}.attn_v.weight": rng.normal(0, 0.02, (kv, HIDDEN)),
            f"blk.{i}.attn_output.weight": rng.normal(0, 0.02, (HIDDEN, HIDDEN)),
            f"blk.{i}.ffn_gate.weight": rng.normal(0, 0.02, (FFN, HIDDEN)),
            f"blk.{i}.ffn_up.weight": rng.normal(0, 0.02, (FFN, HIDDEN)),
            f"blk.{i}.ffn_down.weight": rng.normal(0, 0.02, (HIDDEN, FFN)),
        })
    written = {k: v.astype(np.float32) for k, v in written.items()}
    for name, value in written.items():
        if name == "blk.0.ffn_up.weight":  # one quantised tensor: the loader must dequantise it
            q = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            written[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(value.shape)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
