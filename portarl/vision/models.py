"""Vision-language models: the tiny Qwen-VL models peers test with (built from a config,
no download), local loading with ``AutoProcessor``, and freezing the vision tower.

A vision-language model here is a transformers image-text-to-text model whose config
has a ``vision_config`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``model.model`` runs the
vision tower, puts the image features into the placeholder tokens' embeddings and the
language model over them; ``model.lm_head`` scores tokens. portarl scores completions
from ``model.model``'s last hidden states with the same fused linear log-probs as a text
model (:mod:`portarl.trainer.phases.sequences`), so every op of the numerics path is the
text path's.

The tiny models (``model.path: tiny-qwen2-vl | tiny-qwen2.5-vl | tiny-qwen3-vl``) follow
TRL's tiny configs (2 text layers, vision depth 2) with a head dim of 8 so that all three
M-RoPE sections (time, height, width) are non-empty: a test that built 1-D positions
would see different numbers. Their tokenizer is byte-level (any text encodes) with Qwen's
vision tokens and a Qwen-style chat template.
"""

from __future__ import annotations

from pathlib import Path

import torch

from portarl.vision.compat import images_only_processors

#: ``model.path`` names of the built-in tiny vision-language models -> their family.
#: (Also in :data:`portarl.assets.tokenizer.BUILTIN_MODELS`, the names built in code.)
BUILTIN_VLMS = {"tiny-qwen2-vl": "qwen2_vl", "tiny-qwen2.5-vl": "qwen2_5_vl", "tiny-qwen3-vl": "qwen3_vl"}

#: Qwen's special tokens for chat and images (videos are not trained; their token exists
#: because the processors and configs name it).
VISION_SPECIALS = ("<pad>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                   "<|video_pad|>")

#: Qwen-VL's chat format (ChatML; an image part renders as its vision block) for the tiny
#: models: a message's content is a string or a list of ``{"type": "text", "text": ...}``
#: and ``{"type": "image"}`` parts, as in TRL's conversational data.
VL_CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content is string %}{{- m.content }}{%- else %}{%- for c in m.content %}"
    "{%- if c.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif c.type == 'text' %}{{- c.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Pixels per image of the tiny models' processors (Qwen's min_pixels / max_pixels; 4 to
#: 16 merged patches: the tiny tower stays cheap on a CPU).
TINY_MIN_PIXELS = 4 * 28 * 28
TINY_MAX_PIXELS = 16 * 28 * 28


def is_vision_config(config) -> bool:
    """Whether a transformers config is a vision-language model's (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def is_vision_model(model) -> bool:
    from portarl.assets.lora import base_model

    return is_vision_config(getattr(base_model(model), "config", None))


def vision_tokenizer():
    """A byte-level fast tokenizer with :data:`VISION_SPECIALS` and :data:`VL_CHAT_TEMPLATE`
    (eos ``<|im_end|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(list(VISION_SPECIALS) + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=[t for t in VISION_SPECIALS if t not in ("<pad>", "<|im_end|>")],
                                   model_max_length=1 << 20, clean_up_tokenization_spaces=False)
    fast.chat_template = VL_CHAT_TEMPLATE
    return fast


def _token_ids(tokenizer) -> dict:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_SPECIALS}
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
            "pad_token_id": ids["<pad>"], "eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|im_start|>"]}


def tiny_config(family: str, vocab_size: int, ids: dict, *, hidden_size: int = 32, layers: int = 2,
                max_positions: int = 1024):
    """The config of a tiny ``family`` model (TRL's tiny test configs; 4 heads, so head dim 8
    at the default width; the M-RoPE sections split a head's rotary half 2:1:1, as [2, 1, 1]
    does at head dim 8: a wider model, e.g. 128 for vLLM's CPU attention, keeps all three)."""
    head_dim = hidden_size // 4
    mrope = [head_dim // 4, head_dim // 8, head_dim // 8]
    if hidden_size % 32:
        raise ValueError(f"a tiny vision-language model's hidden_size must be a multiple of 32, got {hidden_size}")
    text = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=True,
                pad_token_id=ids["pad_token_id"], eos_token_id=ids["eos_token_id"], bos_token_id=ids["bos_token_id"])
    special = {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        text["rope_parameters"] = {"rope_type": "default", "mrope_section": mrope, "rope_theta": 10000.0}
        vision = dict(depth=2, embed_dim=16, hidden_size=hidden_size, num_heads=4, mlp_ratio=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **special)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text["rope_parameters"] = {"rope_type": "default", "mrope_section": mrope, "rope_theta": 10000.0}
        vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=4, out_hidden_size=hidden_size,
                      fullatt_block_indexes=[1], window_size=56)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **special)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        text["head_dim"] = head_dim
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": mrope, "mrope_interleaved": True,
                                   "rope_theta": 10000.0}
        vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=4, out_hidden_size=hidden_size,
                      deepstack_visual_indexes=[1], num_position_embeddings=64)
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **special)
    raise ValueError(f"unknown vision-language family {family!r}: use one of {sorted(set(BUILTIN_VLMS.values()))}")


def tiny_processor(family: str, tokenizer=None, *, min_pixels: int = TINY_MIN_PIXELS,
                   max_pixels: int = TINY_MAX_PIXELS):
    """The processor of a tiny ``family`` model: Qwen's image processor (patch 14, or 16 for
    Qwen3-VL; 2 x 2 merge) and :func:`vision_tokenizer`."""
    images_only_processors()
    import transformers
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    from portarl.vision.compat import video_processing_available

    tokenizer = tokenizer or vision_tokenizer()
    patch = 16 if family == "qwen3_vl" else 14
    # Without torchvision, the PIL image processor (what transformers falls back to, said here without its warning).
    kind = "Qwen2VLImageProcessor" if video_processing_available() else "Qwen2VLImageProcessorPil"
    image = getattr(transformers, kind)(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                        min_pixels=min_pixels, max_pixels=max_pixels)
    cls = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[family]
    return cls(image_processor=image, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def builtin_vlm_config(name: str, tokenizer=None, **sizes):
    """The config of the built-in ``name`` (:data:`BUILTIN_VLMS`) without its weights (what
    ``portarl plan`` reads the model's shape from); ``sizes``: :func:`tiny_config`'s."""
    tokenizer = tokenizer or vision_tokenizer()
    return tiny_config(BUILTIN_VLMS[name], len(tokenizer), _token_ids(tokenizer), **sizes)


def build_tiny_vlm(name: str, seed: int = 0, *, hidden_size: int = 32, layers: int = 2):
    """``(model, processor)`` for a built-in name of :data:`BUILTIN_VLMS`, fp32, weights
    drawn from ``seed``."""
    if name not in BUILTIN_VLMS:
        raise ValueError(f"model.path {name!r} is not a built-in vision-language model ({', '.join(BUILTIN_VLMS)})")
    from transformers import AutoModelForImageTextToText

    family = BUILTIN_VLMS[name]
    tokenizer = vision_tokenizer()
    config = builtin_vlm_config(name, tokenizer, hidden_size=hidden_size, layers=layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return model, tiny_processor(family, tokenizer)


def load_processor(directory: str | Path):
    """The processor saved in a vision-language model's directory (no model loaded: what
    ``portarl plan`` counts prompts with). Errors name ``model.path`` and the fix."""
    from transformers import AutoProcessor

    images_only_processors()
    directory = Path(directory)
    try:
        processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"model.path {directory}: a vision-language model needs its processor saved beside it "
                         f"(processor.save_pretrained): {first}") from None
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise ValueError(f"model.path {directory}: {type(processor).__name__} is not an image-text processor "
                         "(it needs an image processor and a tokenizer)")
    return processor


def load_vlm(directory: str | Path, dtype: torch.dtype | None = None):
    """``(model, processor)`` from a local model directory holding a vision-language model
    and its processor (``save_pretrained`` of both; no network)."""
    from transformers import AutoModelForImageTextToText

    directory = Path(directory)
    processor = load_processor(directory)
    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForImageTextToText.from_pretrained(directory, **kwargs)
    return model, processor


def set_pixel_range(processor, min_pixels: int | None, max_pixels: int | None) -> None:
    """Qwen's ``min_pixels`` / ``max_pixels``: every image is resized (aspect kept, sides
    multiples of patch x merge) to hold between these many pixels; None keeps the
    processor's own."""
    image = processor.image_processor
    size = dict(getattr(image, "size", None) or {})
    # transformers >= 5.2x reads the range from ``size`` alone (the min_pixels / max_pixels
    # attributes are deprecated and, once set, passed to every call with a warning).
    if min_pixels is not None:
        size["shortest_edge"] = int(min_pixels)
    if max_pixels is not None:
        size["longest_edge"] = int(max_pixels)
    lo, hi = size.get("shortest_edge"), size.get("longest_edge")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"data.min_pixels {lo} is above data.max_pixels {hi}")
    image.size = size


def vision_parts(model) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """``(tower, projector)``: the vision encoder (``model.model.visual``) and the module
    that projects its features into the language model's space (Qwen's ``merger``)."""
    from portarl.assets.lora import base_model

    inner = getattr(base_model(model), "model", None)
    tower = getattr(inner, "visual", None)
    if tower is None:
        raise ValueError(f"{type(base_model(model)).__name__} has no vision tower at model.visual")
    return tower, getattr(tower, "merger", None)


def freeze_vision(model, *, train_projector: bool = False) -> int:
    """Stop training the vision tower (``model.freeze_vision``, most recipes' default):
    its parameters get ``requires_grad=False``; with ``train_projector`` the projector
    (merger, and Qwen3-VL's deepstack mergers) keeps training. Returns the frozen
    parameter count."""
    tower, projector = vision_parts(model)
    keep = set()
    if train_projector:
        for name in ("merger", "deepstack_merger_list"):
            part = getattr(tower, name, None)
            if part is not None:
                keep.update(id(p) for p in part.parameters())
    frozen = 0
    for p in tower.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def save_vlm(model, processor, directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    processor.save_pretrained(directory)


def vision_refusal(cfg) -> str | None:
    """Why a run with ``cfg`` (a TrainConfig) cannot train a vision-language model yet, or
    None. Refused at start, each with what to change, rather than failing mid-run."""
    r = cfg.rollout
    if r.engine not in ("hf", "vllm"):
        return (f"rollout.engine={r.engine!r} with a vision-language model: its multi-modal requests are not wired yet; "
                "use rollout.engine=hf or vllm")
    if r.engine == "vllm" and getattr(r, "tensor_parallel_size", 1) > 1:
        return ("rollout.tensor_parallel_size > 1 with a vision-language model: the vllm engine's tensor-parallel "
                "groups do not carry images yet; use rollout.tensor_parallel_size=1")
    if getattr(cfg, "tools", None) or getattr(cfg, "environment", None):
        return "tools / environments (multi-turn episodes) with a vision-language model are not supported yet"
    return None
