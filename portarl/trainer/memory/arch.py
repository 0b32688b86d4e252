"""A model's shape for the memory plan, read without loading any weights: the built-in
tiny model from its config section, a Hugging Face directory from ``config.json``, a GGUF
file from its header (the tensors are memory-mapped by the reader, never read), a
vision-language model's language model from its ``text_config`` and its vision tower
(:mod:`portarl.trainer.memory.vision`), and the longest prompt of the data in tokens
(tokenizer, or a vision-language model's processor with the images; no model)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from portarl.trainer.memory.moe import MoeShape, moe_shape_of
from portarl.trainer.memory.vision import ImageStats, VisionTower


@dataclasses.dataclass(frozen=True)
class Arch:
    """A decoder-only transformer of the Llama / Qwen2 family (what portarl trains); a
    vision-language model's language model, with its ``vision`` tower beside it; a
    mixture-of-experts model's MLPs in ``moe`` (:mod:`portarl.trainer.memory.moe`), its
    ``intermediate`` then the width a token goes through (k experts and the shared one)."""

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
    qk_norm: bool = False  # Qwen3: an RMSNorm of head_dim on q and on k
    vision: VisionTower | None = None
    moe: MoeShape | None = None

    @property
    def attention_params(self) -> int:
        """One layer's attention and its two norms (everything but the MLP)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters (an MoE model's largest: what FSDP2 gathers whole)."""
        if self.moe is not None:
            return self.attention_params + self.moe.largest_mlp(self.hidden, self.layers)
        return self.attention_params + 3 * self.hidden * self.intermediate

    @property
    def root_params(self) -> int:
        """Everything outside the decoder layers: embeddings, final norm, untied head."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        """The decoder's (a vision-language model's language model's) parameters."""
        if self.moe is not None:
            return self.layers * self.attention_params + self.moe.mlp_params(self.hidden, self.layers) + self.root_params
        return self.layers * self.layer_params + self.root_params

    @property
    def active_params(self) -> int:
        """The parameters one token goes through: all but the routed experts it skips."""
        return self.params - (0 if self.moe is None else self.moe.inactive_params(self.hidden))

    @property
    def vision_params(self) -> int:
        return 0 if self.vision is None else self.vision.params


#: model_types with biased q, k, v projections when the config does not say; with q / k norms.
_QKV_BIAS = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
_QK_NORM = ("qwen3", "qwen3_vl_text", "qwen3_moe")


def _from_hf_config(data: dict, name: str, tied: bool | None = None) -> Arch:
    hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
    kind = data.get("model_type")
    moe = moe_shape_of(data)
    return Arch(name=name, vocab=int(data["vocab_size"]), hidden=hidden, layers=int(data["num_hidden_layers"]),
                heads=heads, kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or hidden // heads),
                intermediate=int(data["intermediate_size"]) if moe is None else moe.active_intermediate,
                tied=bool(data.get("tie_word_embeddings", False)) if tied is None else tied,
                qkv_bias=bool(data.get("attention_bias", data.get("qkv_bias", kind in _QKV_BIAS))),
                qk_norm=kind in _QK_NORM, moe=moe)


def _from_vlm_config(config, name: str) -> Arch:
    """A vision-language model's transformers config: the language model from its
    ``text_config`` (tied as the wrapper says: transformers ties the head by the top-level
    ``tie_word_embeddings``) and its vision tower."""
    from portarl.trainer.memory.vision import vision_tower_of

    top = config.to_dict()
    text = top["text_config"]
    arch = _from_hf_config(text, name, tied=bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings"))))
    return dataclasses.replace(arch, vision=vision_tower_of(config))


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
    from portarl.moe.models import BUILTIN_MOES, tiny_moe_config
    from portarl.trainer.memory.vision import vlm_config
    from portarl.vision.models import BUILTIN_VLMS

    if model_cfg.path in BUILTIN_VLMS:
        return _from_vlm_config(vlm_config(model_cfg), f"{model_cfg.path} {BUILTIN_VLMS[model_cfg.path]} (built in)")
    if model_cfg.path in BUILTIN_MOES:  # its fixed config (portarl.moe.models) but for the model section's heads
        config = tiny_moe_config(BUILTIN_MOES[model_cfg.path], len(builtin_tokenizer(model_cfg.path)),
                                 heads=model_cfg.heads, kv_heads=model_cfg.kv_heads)
        return _from_hf_config(config.to_dict(), f"{model_cfg.path} {BUILTIN_MOES[model_cfg.path]} (built in)")
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
    if "vision_config" in data:
        return _from_vlm_config(vlm_config(model_cfg), str(data.get("model_type", path.name)))
    top = data
    data = data.get("text_config", data)  # multimodal wrappers keep the decoder's shape there
    return _from_hf_config(data, str(data.get("model_type", path.name)), tied=top.get("tie_word_embeddings"))


def longest_prompt(cfg) -> int:
    """The longest prompt of ``cfg``'s data in tokens, as the trainer encodes it (chat
    template, system prompt, a vision-language model's images); loads the tokenizer (or
    the processor), not the model."""
    return prompt_stats(cfg).longest


def prompt_lengths(cfg) -> tuple[int, int, int]:
    """``(longest prompt, examples, prompt tokens in all)`` of ``cfg``'s data, as the
    trainer encodes it (chat template, system prompt); loads the tokenizer, not the model."""
    stats = prompt_stats(cfg)
    return stats.longest, stats.examples, stats.tokens


@dataclasses.dataclass(frozen=True)
class PromptStats:
    """The data's prompts in tokens (``longest``, ``tokens`` in all, over ``examples``),
    and, for a vision-language model, its images (:class:`ImageStats`)."""

    longest: int
    examples: int
    tokens: int
    images: ImageStats | None = None


def measure_prompts(codec, examples) -> PromptStats:
    """:class:`PromptStats` of ``examples`` encoded by ``codec`` as the trainer encodes them:
    a vision codec counts each prompt with its images (the placeholders expanded to their
    image tokens) and the pixel rows they make, through the processor only."""
    size = getattr(codec, "prompt_size", None)
    if size is None:
        lengths = [len(codec.encode_prompt(ex.prompt)) for ex in examples]
        return PromptStats(max(lengths, default=1), len(lengths), sum(lengths))
    sizes = [size(ex) for ex in examples]
    lengths = [n for n, _, _ in sizes]
    rows = sorted((r for _, _, r in sizes), reverse=True)
    images = ImageStats(pixel_rows=max(rows, default=0), image_tokens=max((t for _, t, _ in sizes), default=0),
                        cached_rows=sum(rows[:codec.pixel_cache]))  # the largest prompts the cache can hold
    return PromptStats(max(lengths, default=1), len(lengths), sum(lengths), images)


def prompt_stats(cfg) -> PromptStats:
    """:func:`measure_prompts` of ``cfg``'s data with ``cfg``'s tokenizer or processor
    (built or loaded without the model)."""
    from portarl.assets.data import arithmetic_examples, load_examples_for
    from portarl.assets.tokenizer import builtin_tokenizer, chat_template_option
    from portarl.trainer.memory.vision import vlm_config, vlm_processor
    from portarl.vision.codec import codec_for

    m, d = cfg.model, cfg.data
    tokenizer = builtin_tokenizer(m.path)
    if tokenizer is None and vlm_config(m) is not None:
        tokenizer = vlm_processor(m)
    elif tokenizer is None:
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
    codec = codec_for(tokenizer, chat_template=chat_template_option(d.chat_template), system_prompt=d.system_prompt)
    return measure_prompts(codec, examples)


__all__ = ["Arch", "PromptStats", "arch_of", "longest_prompt", "measure_prompts", "prompt_lengths", "prompt_stats"]
