"""Models: the built-in tiny Qwen2 (built from a config, no download) and local HF loading."""

from __future__ import annotations

from pathlib import Path

import torch

from portarl.tokenizer import CharTokenizer, load_tokenizer


def tiny_qwen2(vocab_size: int, *, hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               intermediate_size: int = 192, max_positions: int = 128, seed: int = 0):
    """A small Qwen2ForCausalLM (about 100k parameters at the defaults) for CPU demos and tests."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model


def build_tiny(seed: int = 0, **sizes):
    """``(model, tokenizer)``: the built-in default, a tiny Qwen2 with a character tokenizer."""
    tokenizer = CharTokenizer()
    return tiny_qwen2(len(tokenizer), seed=seed, **sizes), tokenizer


def load_local(directory: str | Path, dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` from a local Hugging Face model directory (no network)."""
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    if not (directory / "config.json").exists():
        raise FileNotFoundError(
            f"model directory {directory} has no config.json: pass a local Hugging Face model directory "
            "(save_pretrained output) or 'tiny' for the built-in model"
        )
    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    return model, load_tokenizer(directory)


def save_local(model, tokenizer, directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
