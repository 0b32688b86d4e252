"""A vision-language model's share of the memory plan: its vision tower, its image tokens
and its pixel buffers, read before any weights load.

Why apart from the text model's shape: the tower is a second stack of transformer blocks
over image patches, whose count comes from the data (each image's size, bounded by
``model.min_pixels`` / ``model.max_pixels``), not from the sequence length, and whose
weights are usually frozen (``model.freeze_vision``).

- Parameters: counted exactly by building the tower from its config on the ``meta``
  device (no memory, no weights read; 0.1 s for a 72B model's tower) and summing its
  parameters; the projector is its ``merger`` (and Qwen3-VL's ``deepstack_merger_list``).
  Trainable: none with ``model.freeze_vision`` (the default) or ``model.lora`` (adapters
  on the language model only), the projector with ``model.train_projector``, else all.
- Image tokens: each prompt is counted with its images by the processor
  (:meth:`portarl.vision.codec.VisionCodec.prompt_size`), so they are in the prompt
  lengths the text part of the plan uses.
- Pixel buffers: ``pixel_values`` are fp32 [patches, F], F = in_channels x
  temporal_patch_size x patch_size^2 (1,176 for Qwen2.5-VL, 1,536 for Qwen3-VL), one copy
  per row of a micro-batch or of a rollout chunk (a group's G rows each carry their
  prompt's pixels), and the codec's cache of prompts' pixels in host memory
  (``pixel_cache`` prompts; counted on CPU only, where the host is the device).
- Tower activations (an estimate, per patch, in the dtype's bytes; like the decoder's in
  :mod:`portarl.trainer.memory.plan`): a block of width E and MLP width I keeps its two
  norms' inputs and outputs (4 E), q, k after RoPE, v, the attention output and the
  projection's input (5 E), and its MLP's (SwiGLU: gate, up, silu(gate), product, 4 I;
  GELU: fc1's output and the activation's, 2 I): a_v = 9 E + 4 I or 9 E + 2 I. Each merger
  keeps its norm's input and output and its MLP's hidden and activation (4 E per patch).
  Trainable tower, no checkpointing: depth a_v + mergers. Activation checkpointing (the
  blocks are checkpointed with the decoder's, and the input gradients it switches on
  reach the tower even frozen): each block keeps its input (E) and one block recomputes
  a_v, plus the mergers. Frozen tower without checkpointing: nothing saved (no input or
  weight needs a gradient) but the mergers with ``model.train_projector``. The rollout's
  prefill runs the tower without gradients: one block's a_v for the chunk's patches.
  Not counted: attention scores (SDPA keeps none; the eager kernel on a CPU keeps
  heads x n^2 per image, small at Qwen's image sizes) and the patch embedding's cast of
  the pixels to the model's dtype.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect


@dataclasses.dataclass(frozen=True)
class VisionTower:
    """A vision-language model's vision tower, as the plan needs it."""

    params: int
    projector_params: int  # the merger(s): what model.train_projector trains
    depth: int
    hidden: int  # E, the blocks' width
    intermediate: int  # I, the blocks' MLP width
    gated: bool  # SwiGLU MLP (Qwen2.5-VL) or GELU (Qwen2-VL, Qwen3-VL)
    patch_features: int  # F: pixel_values columns
    mergers: int = 1  # Qwen3-VL: 1 + its deepstack mergers

    def trainable(self, model_cfg) -> int:
        """Parameters of the tower the optimizer updates (module docstring)."""
        if model_cfg.lora is not None:
            return 0
        if not model_cfg.freeze_vision:
            return self.params
        return self.projector_params if model_cfg.train_projector else 0

    @property
    def block_activation_elements(self) -> int:
        """``a_v``: elements one block saves per patch for its backward (module docstring)."""
        return 9 * self.hidden + (4 if self.gated else 2) * self.intermediate

    def saved_activation_elements(self, *, trainable: bool, projector: bool, checkpointing: bool) -> int:
        """Elements the tower saves per patch of a training forward (module docstring)."""
        mergers = 4 * self.hidden * self.mergers
        if checkpointing:
            return self.depth * self.hidden + self.block_activation_elements + mergers
        if trainable:
            return self.depth * self.block_activation_elements + mergers
        return mergers if projector else 0


@dataclasses.dataclass(frozen=True)
class ImageStats:
    """The data's images as the processor makes them: the most pixel rows (patches) and
    image tokens one prompt has, and the pixel rows the codec's cache holds at most."""

    pixel_rows: int
    image_tokens: int
    cached_rows: int


def _tower_class(vision_config):
    """The transformers class built from ``vision_config`` (in its family's modeling
    module, the ``PreTrainedModel`` whose ``config_class`` it is), or None."""
    from transformers import PreTrainedModel

    name = type(vision_config).__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    for obj in vars(module).values():
        if inspect.isclass(obj) and issubclass(obj, PreTrainedModel) and obj.config_class is type(vision_config):
            return obj
    return None


def _meta_tower(config):
    """``config``'s vision tower with its parameters on the ``meta`` device (no storage)."""
    import torch

    cls = _tower_class(config.vision_config)
    with torch.device("meta"):
        if cls is not None:
            return cls._from_config(config.vision_config)
        from transformers import AutoModelForImageTextToText

        from portarl.vision.models import vision_parts

        return vision_parts(AutoModelForImageTextToText.from_config(config))[0]  # the whole model: slower


def vision_tower_of(config) -> VisionTower:
    """The :class:`VisionTower` of a vision-language model's transformers ``config``."""
    tower = _meta_tower(config)
    vc = config.vision_config
    projector = {id(p): p.numel() for name in ("merger", "deepstack_merger_list") if hasattr(tower, name)
                 for p in getattr(tower, name).parameters()}
    hidden = int(getattr(vc, "embed_dim", None) or vc.hidden_size)  # Qwen2-VL: hidden_size is the merger's output
    intermediate = getattr(vc, "intermediate_size", None) or int(hidden * vc.mlp_ratio)
    blocks = getattr(tower, "blocks", None)
    gated = bool(blocks) and hasattr(blocks[0].mlp, "gate_proj")
    features = int(getattr(vc, "in_channels", 3)) * int(getattr(vc, "temporal_patch_size", 2)) * int(vc.patch_size) ** 2
    return VisionTower(params=sum(p.numel() for p in tower.parameters()), projector_params=sum(projector.values()),
                       depth=int(vc.depth), hidden=hidden, intermediate=int(intermediate), gated=gated,
                       patch_features=features, mergers=1 + len(getattr(vc, "deepstack_visual_indexes", None) or ()))


def vlm_config(model_cfg):
    """The transformers config of the vision-language model ``model.path`` names (a built-in
    tiny one, or a directory whose ``config.json`` has a ``vision_config``), or None."""
    from portarl.vision.models import BUILTIN_VLMS, builtin_vlm_config

    if model_cfg.path in BUILTIN_VLMS:
        return builtin_vlm_config(model_cfg.path)
    from portarl.assets.models import is_vision_directory, resolve_model_path

    path = resolve_model_path(model_cfg.path)
    if path.suffix == ".gguf" or not is_vision_directory(path):
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def vlm_processor(model_cfg):
    """The processor of the vision-language model ``model.path`` names, without the model,
    its pixel range set as the trainer sets it (``model.min_pixels`` / ``max_pixels``)."""
    from portarl.vision.models import BUILTIN_VLMS, load_processor, set_pixel_range, tiny_processor

    if model_cfg.path in BUILTIN_VLMS:
        processor = tiny_processor(BUILTIN_VLMS[model_cfg.path])
    else:
        from portarl.assets.models import resolve_model_path

        processor = load_processor(resolve_model_path(model_cfg.path))
    set_pixel_range(processor, model_cfg.min_pixels, model_cfg.max_pixels)
    return processor


def vision_parts(tower: VisionTower, model_cfg, images: ImageStats | None, *, b: int, devices: int, masters: bool,
                 b_opt: int, rows: int, chunk: int, checkpointing: bool, accelerator: bool) -> dict:
    """The tower's parts of the plan, by name (bytes per device; module docstring).
    ``rows``: the largest micro-batch's rows; ``chunk``: the rollout's decode chunk."""
    w = max(1, devices)
    trainable = tower.trainable(model_cfg)
    if w > 1:  # sharded, and gathered whole with the root (the tower is not a decoder layer)
        weights = tower.params * (4 if masters else b) // w + tower.params * b
        grads = trainable * (4 if masters else b) // w
    else:
        weights = tower.params * b
        grads = trainable * b + (4 * trainable if masters else 0)
    images = images or ImageStats(0, 0, 0)
    patches, row_bytes = images.pixel_rows, images.pixel_rows * tower.patch_features * 4
    whole = model_cfg.lora is None and not model_cfg.freeze_vision
    saved = tower.saved_activation_elements(trainable=whole, projector=trainable > 0, checkpointing=checkpointing)
    return {"vision tower weights": weights,
            "vision tower optimizer state": 2 * trainable * b_opt // w,
            "vision tower gradients": grads,
            "vision tower activations": saved * b * rows * patches,
            "pixel buffers (micro-batch)": rows * row_bytes,
            "pixel buffers (rollout)": chunk * row_bytes,
            "rollout vision tower forward": tower.block_activation_elements * b * chunk * patches,
            "pixel cache (host)": 0 if accelerator else images.cached_rows * tower.patch_features * 4}


__all__ = ["ImageStats", "VisionTower", "vision_parts", "vision_tower_of", "vlm_config", "vlm_processor"]
