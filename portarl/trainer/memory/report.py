"""The memory plan as a person reads it: ``portarl plan``'s report (:func:`render`), what
to change when it does not fit (:func:`advice`) and the one line ``portarl train`` logs at
start (:func:`one_line`). The numbers come from :mod:`portarl.trainer.memory.plan`."""

from __future__ import annotations

from portarl.trainer.memory.engine import gib
from portarl.trainer.memory.plan import Plan


def advice(plan: Plan, cfg) -> list[str]:
    """What to change when the plan does not fit (largest saving first)."""
    if plan.fits is not False:
        return []
    tips = []
    over = plan.peak - plan.device_memory
    if plan.phase == "update" and not plan.checkpointing:
        tips.append(f"train.gradient_checkpointing=true (saved activations {gib(plan.parts['saved activations'])} -> "
                    f"{gib(plan.activations_other)})")
    if plan.phase == "update" and plan.micro_batch_tokens > plan.sequence_tokens:
        tips.append(f"a smaller train.max_tokens_per_micro_batch (now {cfg.train.max_tokens_per_micro_batch}; "
                    f"{_micro_batch(plan)})")
    if plan.phase == "optimizer step" and plan.parts.get("update snapshot"):
        tips.append("guards.update_snapshot=false (no copy of the parameters and optimizer state during the step)")
    if plan.phase == "rollout" and cfg.rollout.engine == "hf":
        tips.append("a smaller rollout.max_batch_size (the KV cache grows with it)")
    if cfg.rollout.engine == "vllm":
        if cfg.rollout.mode == "colocated" and not cfg.rollout.sleep_level:
            tips.append("rollout.sleep_level=1 (vLLM frees its memory while the trainer trains)")
        tips.append(f"a smaller rollout.vllm_gpu_memory_utilization (now {cfg.rollout.vllm_gpu_memory_utilization:g}; "
                    "vLLM's KV cache fills its share)")
    if plan.parts.get("KL reference"):
        tips.append("loss.kl_coef=0 or model.lora (no reference copy)")
    if cfg.precision.dtype == "fp32":
        tips.append("precision.dtype=bf16")
    tips.append(f"more devices (FSDP2 divides parameters, gradients and optimizer state); {gib(over)} over")
    return tips


def _micro_batch(plan: Plan) -> str:
    if plan.sequence_parallel > 1:
        return (f"{plan.micro_batch_tokens} tokens per rank, 1/{plan.sequence_parallel} of its sequence-parallel "
                f"group's (sequences of at most {plan.sequence_tokens} tokens, up to {plan.micro_batch_rows}, each cut "
                f"across {plan.sequence_parallel} ranks)")
    if plan.padding_free:
        return (f"{plan.micro_batch_tokens} tokens, padding-free (sequences of at most {plan.sequence_tokens} tokens, "
                f"up to {plan.micro_batch_rows})")
    return f"{plan.micro_batch_rows} sequences x {plan.sequence_tokens} tokens"


def render(plan: Plan, cfg) -> str:
    a = plan.arch
    what = "parameters" if a.vision is None else "language-model parameters"
    lines = [f"model: {a.name}: {a.params / 1e6:.1f}M {what}, {a.layers} layers, hidden {a.hidden}, "
             f"vocab {a.vocab}; {cfg.precision.dtype}; {plan.devices} device(s)"
             + (" (FSDP2)" if plan.devices > 1 else "")
             + (f", sequence parallel {plan.sequence_parallel} (Ulysses)" if plan.sequence_parallel > 1 else ""),
             *_vision_lines(plan, cfg),
             *plan.model_lines,
             f"largest micro-batch: {_micro_batch(plan)}; activation checkpointing "
             f"{'on' if plan.checkpointing else 'off'}", "",
             "peak memory per device, by part:"]
    for name, value in plan.parts.items():
        if value:
            lines.append(f"  {name:<32}{gib(value):>12}")
    other = "off" if plan.checkpointing else "on"
    lines.append(f"  (saved activations with checkpointing {other}: {gib(plan.activations_other)})")
    lines += plan.notes
    phases = ", ".join(f"{k} {gib(v)}" for k, v in plan.phases.items())
    lines.append(f"held {gib(plan.static)} + the largest phase: {phases}")
    lines.append(f"estimated peak: {gib(plan.peak)} per device (in the {plan.phase} phase)")
    if plan.device_memory is not None:
        verdict = "fits" if plan.fits else "does NOT fit"
        lines.append(f"device memory {gib(plan.device_memory)}: {verdict}")
        lines += [f"  change: {tip}" for tip in advice(plan, cfg)]
    return "\n".join(lines)


def _vision_lines(plan: Plan, cfg) -> list[str]:
    """A vision-language model's tower (its parameters, how many train and why) and its
    images (the most image tokens and patches one prompt has); none for a text model."""
    v, m = plan.arch.vision, cfg.model
    if v is None:
        return []
    trainable = v.trainable(m)
    why = ("model.lora: the language model's adapters only" if m.lora is not None else
           "model.freeze_vision=false" if not m.freeze_vision else
           "model.train_projector: the projector" if m.train_projector else "model.freeze_vision")
    lines = [f"vision tower: {v.params:,} parameters, depth {v.depth}, width {v.hidden}; {trainable:,} trainable ({why})"]
    if plan.images is not None and plan.images.pixel_rows:
        i = plan.images
        lines.append(f"images: up to {i.image_tokens:,} image tokens per prompt (in the prompt lengths), from "
                     f"{i.pixel_rows:,} patches of {v.patch_features:,} fp32 values (pixel buffers: "
                     f"{gib(i.pixel_rows * v.patch_features * 4)} per row)")
    return lines


def one_line(plan: Plan) -> str:
    device = f", device memory {gib(plan.device_memory)}" if plan.device_memory else ""
    return (f"memory plan: estimated peak {gib(plan.peak)} per device ({plan.phase} phase, activation checkpointing "
            f"{'on' if plan.checkpointing else 'off'}){device}")


__all__ = ["advice", "one_line", "render"]
