"""A model's shape for the memory plan, read without loading any weights: the built-in
tiny model from its config section, a Hugging Face directory from ``config.json``, a GGUF
file from its header (the tensors are memory-mapped by the reader, never read), and the
longest prompt of the data in tokens (tokenizer only)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Arch:
    """A decoder-only transformer of the Llama / Qwen2 family (what portarl trains)."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qkv_bias: bool = False

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate + 2 * h

    @property
    def root_params(self) -> int:
        """Everything outside the decoder layers: embeddings, final norm, untied head."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


def _from_hf_config(data: dict, name: str) -> Arch:
    hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
    return Arch(name=name, vocab=int(data["vocab_size"]), hidden=hidden, layers=int(data["num_hidden_layers"]),
                heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or hidden // heads), intermediate=int(data["intermediate_size"]),
                tied=bool(data.get("tie_word_embeddings", False)),
                qkv_bias=bool(data.get("attention_bias", data.get("model_type") == "qwen2")))


def _from_gguf(path: Path) -> Arch:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ImportError("reading a .gguf header needs the gguf package: pip install 'portarl[gguf]'") from None
    reader = GGUFReader(path)

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    hidden, heads = int(field(f"{arch}.embedding_length")), int(field(f"{arch}.attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = field(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return Arch(name=f"{arch} ({path.name})", vocab=int(vocab), hidden=hidden, layers=int(field(f"{arch}.block_count")),
                heads=heads, kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
                head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
                intermediate=int(field(f"{arch}.feed_forward_length")), tied="output.weight" not in names,
                qkv_bias="blk.0.attn_q.bias" in names)


def arch_of(model_cfg) -> Arch:
    """The shape of the model a ``ModelConfig`` names (no weights read)."""
    from portarl.assets.tokenizer import builtin_tokenizer

    tokenizer = builtin_tokenizer(model_cfg.path)
    if tokenizer is not None:
        m = model_cfg
        return Arch(name=f"{m.path} Qwen2 (built in)", vocab=len(tokenizer), hidden=m.hidden_size, layers=m.layers,
                    heads=m.heads, kv_heads=m.kv_heads, head_dim=m.hidden_size // m.heads,
                    intermediate=m.intermediate_size, tied=True, qkv_bias=True)
    from portarl.assets.models import resolve_model_path

    path = resolve_model_path(model_cfg.path)
    if path.suffix == ".gguf":
        return _from_gguf(path)
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"model.path {path}: no config.json (a Hugging Face model directory or a .gguf file "
                                "was expected)")
    data = json.loads(config.read_text())
    data = data.get("text_config", data)  # multimodal wrappers keep the decoder's shape there
    return _from_hf_config(data, str(data.get("model_type", path.name)))


def longest_prompt(cfg) -> int:
    """The longest prompt of ``cfg``'s data in tokens, as the trainer encodes it (chat
    template, system prompt); loads the tokenizer, not the model."""
    return prompt_lengths(cfg)[0]


def prompt_lengths(cfg) -> tuple[int, int, int]:
    """``(longest prompt, examples, prompt tokens in all)`` of ``cfg``'s data, as the
    trainer encodes it (chat template, system prompt); loads the tokenizer, not the model."""
    from portarl.assets.data import arithmetic_examples, load_examples_for
    from portarl.assets.tokenizer import as_codec, chat_template_option

    from portarl.assets.tokenizer import builtin_tokenizer

    m, d = cfg.model, cfg.data
    tokenizer = builtin_tokenizer(m.path)
    if tokenizer is None:
        from portarl.assets.models import resolve_model_path

        path = resolve_model_path(m.path)
        if path.suffix == ".gguf":
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        else:
            from portarl.assets.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(path)
    if d.path is None:
        examples = arithmetic_examples(d.synthetic_size, seed=cfg.train.seed, max_operand=d.max_operand, ops=d.operators)
    else:
        examples = load_examples_for(d)
    codec = as_codec(tokenizer, chat_template=chat_template_option(d.chat_template), system_prompt=d.system_prompt)
    lengths = [len(codec.encode_prompt(ex.prompt)) for ex in examples]
    return max(lengths), len(lengths), sum(lengths)


__all__ = ["Arch", "arch_of", "longest_prompt", "prompt_lengths"]
