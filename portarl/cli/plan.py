"""``portarl plan``: whether a training config fits its devices, before any weights load.

Reads the model's shape (``config.json`` or the GGUF header; a vision-language model's
tower too) and the data's longest prompt (tokenizer only; a vision-language model's
processor with the images, for their image tokens and pixels), then prints the per-device peak by part from
:mod:`portarl.trainer.memory.plan`, whether it fits, and what to change. Exit 0: fits; 1:
does not fit; 2: a usage or config error.
"""

from __future__ import annotations

import os

from portarl.cli.config import UsageError, check_model_dir, load_config, log


def add_arguments(p) -> None:
    p.add_argument("--config", help="training config YAML (default: the built-in demo config)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field, e.g. train.micro_batch_size=8")
    p.add_argument("--devices", type=int, default=1, help="devices (FSDP2 ranks) the run will use (default 1)")
    p.add_argument("--device-memory", help="memory of one device, e.g. 80GiB or 64GB (default: this machine's "
                                           "accelerator, or its RAM on CPU)")
    p.add_argument("--prompt-tokens", type=int, help="longest prompt in tokens (default: read from the data)")
    p.set_defaults(device=None, output_dir=None, steps=None)


def local_device_memory(device: str = "auto") -> tuple[int | None, bool]:
    """``(bytes, accelerator)`` of this machine's device: the accelerator's memory, else the RAM."""
    import torch

    try:
        if device in ("auto", "cuda") and torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, True
        npu = getattr(torch, "npu", None)
        if device in ("auto", "npu") and npu is not None and npu.is_available():
            return npu.get_device_properties(npu.current_device()).total_memory, True
    except Exception:  # noqa: BLE001 - no device: fall back to the host
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), False
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return None, False


def cmd_plan(args) -> int:
    from portarl.trainer.memory.arch import arch_of, prompt_stats
    from portarl.trainer.memory.plan import estimate, parse_size
    from portarl.trainer.memory.report import render

    try:
        config = load_config(args, "plan")
        check_model_dir(config.model.path)
        if args.devices < 1:
            raise UsageError(f"--devices must be an integer >= 1, got {args.devices}")
        if config.train.prompts_per_step % args.devices:
            raise UsageError(f"train.prompts_per_step={config.train.prompts_per_step} must be a multiple of "
                             f"--devices {args.devices} (each rank rolls out whole groups)")
        if args.devices > 1 and config.model.lora is not None:
            raise UsageError("model.lora is not supported with several devices (FSDP2) yet; plan with --devices 1")
        if args.prompt_tokens is not None and args.prompt_tokens < 1:
            raise UsageError(f"--prompt-tokens must be an integer >= 1, got {args.prompt_tokens}")
        if args.device_memory is not None:
            memory, accelerator = parse_size(args.device_memory), config.device not in ("cpu",)
        else:
            memory, accelerator = local_device_memory(config.device)
        arch = arch_of(config.model)
        stats = prompt_stats(config)
        prompt = args.prompt_tokens or stats.longest
    except UsageError as err:
        log(f"portarl plan: {err}")
        return 2
    except (ValueError, FileNotFoundError, ImportError, KeyError) as err:
        log(f"portarl plan: {err}")
        return 2
    plan = estimate(config, arch, prompt_tokens=prompt, devices=args.devices, device_memory=memory,
                    accelerator=accelerator, examples=stats.examples, data_tokens=stats.tokens, images=stats.images)
    print(render(plan, config))
    return 0 if plan.fits is not False else 1


def train_start_line(config, tokenizer, examples, device) -> str:
    """The one line ``portarl train`` logs at its start: estimated peak and device memory
    (the prompts encoded as the trainer will, a vision-language model's with their images;
    devices: torchrun's ``WORLD_SIZE``)."""
    from portarl.assets.tokenizer import chat_template_option
    from portarl.trainer.memory.arch import arch_of, measure_prompts
    from portarl.trainer.memory.plan import estimate
    from portarl.trainer.memory.report import one_line
    from portarl.vision.codec import codec_for

    d = config.data
    codec = codec_for(tokenizer, chat_template=chat_template_option(d.chat_template), system_prompt=d.system_prompt)
    stats = measure_prompts(codec, examples)
    memory, accelerator = local_device_memory(device.type)
    plan = estimate(config, arch_of(config.model), prompt_tokens=stats.longest,
                    devices=int(os.environ.get("WORLD_SIZE", "1")), device_memory=memory, accelerator=accelerator,
                    examples=stats.examples, data_tokens=stats.tokens, images=stats.images)
    return one_line(plan)


def log_train_plan(config, tokenizer, examples, device) -> None:
    """:func:`train_start_line` on stderr, from rank 0; an estimate never stops a run."""
    if os.environ.get("RANK", "0") != "0":
        return
    try:
        line = train_start_line(config, tokenizer, examples, device)
    except Exception as err:  # noqa: BLE001 - a bad prompt is the trainer's error to report, with its file:line
        line = f"memory plan unavailable ({type(err).__name__}: {err})"
    log(f"portarl train: {line}")


__all__ = ["add_arguments", "cmd_plan", "local_device_memory", "log_train_plan", "train_start_line"]
