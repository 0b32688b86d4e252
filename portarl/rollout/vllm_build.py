"""Building the vllm engine (:class:`portarl.rollout.vllm.VLLMRollout`) for a run: the
model directory it starts from, its ``rollout.vllm_*`` settings, and for a vision-language
model what vLLM must know beforehand: how long a prompt with images may be, how many images
a prompt holds, and the run's pixel range (``model.min_pixels`` / ``model.max_pixels``,
which decide each image's token count and must be vLLM's too)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from portarl.rollout.vllm import MULTITURN_MODEL_LEN, VLLMRollout

#: ``rollout.vllm_max_model_len`` unset: the prompt positions a text prompt may take.
PROMPT_BUDGET = 64


def vision_settings(processor, prompt_ids, examples) -> dict:
    """``VLLMRollout`` keywords for a vision-language model: the longest prompt (its image
    tokens included; at least :data:`PROMPT_BUDGET`), the most images in a row, and the
    processor's pixel range as vLLM's ``mm_processor_kwargs``; {} for a text model."""
    image = getattr(processor, "image_processor", None)
    if image is None:
        return {}
    size = dict(getattr(image, "size", None) or {})
    edges = {k: int(v) for k, v in (("shortest_edge", size.get("shortest_edge", getattr(image, "min_pixels", None))),
                                    ("longest_edge", size.get("longest_edge", getattr(image, "max_pixels", None))))
             if v is not None}
    longest = max((len(ids) for ids in prompt_ids), default=0)
    images = max((len(getattr(ex, "images", ()) or ()) for ex in examples), default=0)
    return {"prompt_budget": max(PROMPT_BUDGET, longest), "max_images": max(1, images),
            "mm_processor_kwargs": {"size": edges} if edges else {}}


def model_dir_for(cfg, model: torch.nn.Module, tokenizer, scratch: str | Path) -> Path:
    """The directory vLLM starts from: ``model.path`` when it is a model directory, else a
    copy of ``model`` saved once as ``<scratch>/rollout-init-model`` (the built-in tiny
    models exist only in memory). Only the architecture matters: the weights are replaced
    by :meth:`VLLMRollout.sync_weights` before the first generation."""
    from portarl.assets.tokenizer import BUILTIN_MODELS

    model_dir = Path(cfg.model.path) if cfg.model.path not in BUILTIN_MODELS else None
    if model_dir is None or not (model_dir / "config.json").exists():
        model_dir = Path(scratch) / "rollout-init-model"
        if not (model_dir / "config.json").exists():
            from portarl.assets.lora import save_merged  # a plain HF directory, also for a LoRA model

            save_merged(model, model_dir, tokenizer)
    return model_dir


def engine_from_config(cfg, model_dir: str | Path, stop_token_ids: list[int], dtype: torch.dtype,
                       **launch) -> VLLMRollout:
    """The vllm engine with the ``rollout.vllm_*`` settings of a TrainConfig, in this process:
    the trainer's (colocated) or the asynchronous rollout worker's (``rollout.mode: async``).
    ``launch``: :class:`VLLMRollout`'s ``external_launcher``, ``tensor_parallel_size`` and
    ``load_format`` (torchrun); a vision-language model's :func:`vision_settings`."""
    r = cfg.rollout
    prompt_budget = launch.pop("prompt_budget", PROMPT_BUDGET)
    # Multi-turn episodes (tools / environment) grow past one prompt and one completion.
    default_len = MULTITURN_MODEL_LEN if (cfg.tools or cfg.environment is not None) else prompt_budget + r.max_new_tokens
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weight sync without IPC copies
    return VLLMRollout(
        model_dir, eos_token_id=stop_token_ids, dtype=dtype,
        gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        max_model_len=r.vllm_max_model_len or default_len,
        seed=cfg.train.seed, enforce_eager=r.vllm_enforce_eager, sleep_level=r.sleep_level,
        additional_config=r.vllm_additional_config, sync_bucket_mb=r.sync_bucket_mb,
        record_routing=r.routing_replay == "rollout", **launch,
    )


def engine_from_trainer(trainer, dtype: torch.dtype | None = None) -> VLLMRollout:
    """Build the vllm engine for a GRPOTrainer: from the model directory when the model came
    from one, else from a copy of the in-memory model saved once under ``output_dir``.

    Under torchrun (FSDP2 shards): one engine on every rank (vLLM's external launcher), in
    ``dtype`` (the run's ``precision.dtype``); a model that came from no directory starts
    from random weights and its ``config.json`` alone, written to a temporary directory of
    this rank (no weights file: the first sync loads the trainer's, in memory). Every rank
    must build it at the same point (vLLM all-reduces the KV-cache size over the ranks)."""
    evaluator = getattr(trainer, "evaluator", None)
    examples = list(trainer.examples) + list(getattr(evaluator, "examples", None) or [])
    prompt_ids = [trainer.encoded_prompt(ex) for ex in trainer.examples]
    prompt_ids += list(getattr(evaluator, "prompt_ids", None) or [])
    vision = vision_settings(trainer.tokenizer, prompt_ids, examples)
    if not trainer.dist.enabled:
        model_dir = model_dir_for(trainer.config, trainer.model, trainer.tokenizer, trainer.output_dir)
        return engine_from_config(trainer.config, model_dir, trainer.codec.stop_token_ids,
                                  next(trainer.model.parameters()).dtype, **vision)
    import shutil
    import tempfile

    from portarl.assets.lora import base_model

    model_dir, scratch, load_format = Path(trainer.config.model.path), None, None
    if not (model_dir / "config.json").exists():
        scratch = Path(tempfile.mkdtemp(prefix=f"portarl-vllm-rank{trainer.dist.rank}-"))
        base_model(trainer.model).config.save_pretrained(scratch)  # config.json only
        if vision:
            trainer.tokenizer.save_pretrained(scratch)  # the processor: vLLM runs it on the images
        model_dir, load_format = scratch, "dummy"
    try:
        engine = engine_from_config(trainer.config, model_dir, trainer.codec.stop_token_ids, dtype,
                                    external_launcher=True, load_format=load_format,
                                    tensor_parallel_size=trainer.config.rollout.tensor_parallel_size, **vision)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)  # read at start only
    return engine
