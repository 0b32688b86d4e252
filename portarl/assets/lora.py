"""LoRA through ``peft``: wrapping the model, the merged weights vLLM and ``portarl export``
need, and the adapter-only checkpoint files.

Why a module of its own: LoRA touches model set-up, the reference, checkpoints, the weight
sync and export; each of those calls one helper here instead of knowing peft's layout.

- :func:`apply_lora` wraps a Hugging Face model with ``peft.get_peft_model``: only the
  adapter parameters keep ``requires_grad``, so the optimizer, the fp32 master weights and
  the guards (which all collect trainable parameters) see the adapter only. The adapter's
  random init is seeded, so two runs with the same config start identical.
- The KL reference is the same model with the adapter disabled
  (:func:`portarl.trainer.phases.reference.reference_model`): no second copy of the weights.
- :func:`merged_state_dict` gives ``W + scaling * B @ A`` under the base model's own
  parameter names, computed on the side: the training model is never merged in place
  (merging and unmerging in low precision would drift the base weights).
- Checkpoints hold ``adapter_model.safetensors`` + ``adapter_config.json`` (peft's own
  format, loadable with ``PeftModel.from_pretrained``), never the base weights: those are
  rebuilt from ``model.path`` (or the tiny model's seed) on resume and export.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from portarl.runtime.distributed import full

# peft's save_pretrained asks transformers a deprecated question on every checkpoint; the
# answer is right, the FutureWarning is noise in every run's log.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
INSTALL_HINT = "pip install 'portarl[lora]'"


class LoraUnavailable(ImportError):
    """``model.lora`` is set but peft is not installed; the message names the extra."""


def require_peft():
    try:
        import peft
    except ImportError:
        raise LoraUnavailable(f"model.lora needs the peft package: {INSTALL_HINT}") from None
    return peft


def is_lora(model) -> bool:
    """``model`` is a peft model (without importing peft when it is not installed)."""
    return any(cls.__module__.startswith("peft.") and cls.__name__ == "PeftModel" for cls in type(model).__mro__)


def apply_lora(model, lora, seed: int = 0):
    """``model`` wrapped with LoRA adapters as ``lora`` (a ``LoraSection``) says. Errors
    name ``model.lora.*``."""
    peft = require_peft()
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    extra = {}
    if getattr(getattr(model, "config", None), "vision_config", None) is not None:
        # A vision-language model: adapters on the language model only (the vision tower's MLP
        # has gate/up/down_proj too, and freeze_vision keeps the tower as it is).
        extra["exclude_modules"] = r".*\bvisual\b.*"
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                             bias="none", **extra)
    head = model.get_output_embeddings()  # before wrapping: peft replaces it when it is a target
    with torch.random.fork_rng(devices=[]):  # the adapter init, seeded, leaves the run's RNG stream alone
        torch.manual_seed(seed)
        try:
            wrapped = peft.get_peft_model(model, config)
        except ValueError as err:
            raise ValueError(f"model.lora.target_modules={lora.target_modules!r}: {err}") from None
    odd = [name for name, layer in _lora_layers(wrapped)
           if not isinstance(layer.get_base_layer(), torch.nn.Linear) or layer.get_base_layer() is head]
    if odd:  # an embedding or the (often tied) head: merged weights would not be the trained model
        raise ValueError(f"model.lora.target_modules={lora.target_modules!r} adapts {odd[:3]}: portarl supports "
                         "adapters on the decoder's linear layers only (not embeddings or the output head)")
    return wrapped


def base_model(model):
    """The Hugging Face model inside a peft model (with the adapter layers in it)."""
    return model.get_base_model() if is_lora(model) else model


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    inner = base_model(model)
    return [(name, module) for name, module in inner.named_modules() if isinstance(module, LoraLayer)]


def merged_tensors(model, skip=frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`merged_state_dict` one ``(name, tensor)`` at a time, in the state dict's order,
    each tensor whole (:func:`full`), the names in ``skip`` left out (not gathered either).

    Under FSDP2 (torchrun) every tensor is a shard: each is gathered, and an adapted
    layer's weight is folded from its gathered base weight and its gathered ``lora_A`` /
    ``lora_B`` when the weight's turn comes, so no rank holds more than one layer's full
    tensors beyond its shards, every rank runs the same gathers in the same order (the
    caller exhausts the generator on every rank), and the fold is the one a single
    process computes from the same full weights, bitwise. Folding the shards instead
    (DTensor arithmetic) would run other matmuls than one process's (on row blocks, which
    a CPU kernel does not always round alike: ``B[:9] @ A`` against the first rows of
    ``B @ A`` for a 17x8 ``B`` and an 8x33 ``A`` differ in the last bit), and would hold a
    merged copy of every adapted weight before the first tensor comes out."""
    if not is_lora(model):
        for name, tensor in model.state_dict().items():
            if name not in skip:
                yield name, full(tensor.detach())
        return
    layers = {f"{name}.weight": layer for name, layer in _lora_layers(model)
              if not getattr(layer, "merged", False) and not getattr(layer, "disable_adapters", False)}
    for key, tensor in base_model(model).state_dict().items():
        parts = key.split(".")
        name = ".".join(p for p in parts if p != "base_layer")
        if name in skip or any(p.startswith("lora_") for p in parts):
            continue
        tensor = full(tensor.detach())
        layer = layers.get(name)
        if layer is not None:  # W + scaling * B @ A, summed in fp32, stored in W's dtype
            weight = tensor.float()
            for a in layer.active_adapters:
                if a in layer.lora_A:  # nn.Linear adapters only (apply_lora refuses the others)
                    delta = (full(layer.lora_B[a].weight.detach()).float()
                             @ full(layer.lora_A[a].weight.detach()).float()) * layer.scaling[a]
                    weight = weight + (delta.T if getattr(layer, "fan_in_fan_out", False) else delta)
            tensor = weight.to(tensor.dtype)
        yield name, tensor


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights of ``model`` with every active adapter folded in (``W + scaling * B @ A``,
    summed in fp32, stored in ``W``'s dtype), under the base model's parameter names (no
    ``base_model.model.``, no ``.base_layer``, no ``lora_*``). A non-peft model: its own
    ``state_dict``. The model itself is left as it was (not merged). An FSDP2-sharded
    model: every tensor gathered whole (collective; :func:`merged_tensors` gives them one at
    a time)."""
    return dict(merged_tensors(model))


def save_merged(model, directory: str | Path, tokenizer=None) -> Path:
    """Write ``model`` with its adapter merged as a plain Hugging Face model directory
    (safetensors, config, and the tokenizer when given): what vLLM and ``portarl export``
    load. The training model is not changed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if is_lora(model):
        base_model(model).save_pretrained(directory, state_dict=merged_state_dict(model), safe_serialization=True)
    else:
        model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    from portarl.runtime.fileperms import normalize_modes

    normalize_modes(directory)  # safetensors writes model.safetensors 0600
    return directory


def load_adapter(model, directory: Path) -> None:
    """Load ``adapter_model.safetensors`` from a checkpoint into ``model``'s adapter,
    exactly (every adapter tensor must be there, nothing else may be)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from portarl.runtime.errors import CheckpointError

    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} holds no {ADAPTER_WEIGHTS} but the run has model.lora set: "
                              "it was written without LoRA", directory, ADAPTER_WEIGHTS)
    try:
        saved = load_file(str(path))
    except Exception as err:  # safetensors' own error types for a bad header
        raise CheckpointError(f"checkpoint {directory}: {ADAPTER_WEIGHTS} cannot be read ({err})", directory,
                              ADAPTER_WEIGHTS) from None
    result = set_peft_model_state_dict(model, saved)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint {directory}: the adapter does not match model.lora: missing {missing[:5]}, "
                           f"unexpected {list(result.unexpected_keys)[:5]}")
