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
from portarl.trainer.config.critic import CriticConfig  # noqa: F401  (public here too)
from portarl.trainer.config.lora import LORA_DEFAULT_TARGETS, LoraSection, lora_section  # noqa: F401
from portarl.trainer.config.rewards import RewardSpec, default_rewards as _default_rewards, validate_rewards
from portarl.trainer.config.rollout import RolloutConfig  # noqa: F401  (public here too)
from portarl.trainer.config.safety import GuardsConfig, PrecisionConfig  # noqa: F401  (public here too)
from portarl.trainer.config.model_data import DataConfig, ModelConfig  # noqa: F401  (public here too)
from portarl.trainer.config.training import OptimConfig, TrainSection  # noqa: F401  (public here too)
from portarl.trainer.config.trackers import (  # noqa: F401  (public here too)
    SECTIONS,
    MlflowSection,
    SwanlabSection,
    TrackioSection,
    WandbSection,
    tracker_list,
    tracker_section,
)


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
    #: Under torchrun with one rank (``--nproc-per-node 1``): shard the model with FSDP2
    #: anyway, so that the sharded path (the mixed-precision policy over fp32 masters, the
    #: sharded checkpoint) runs on one device; ``portarl hardware-check`` uses it to check
    #: that path on a lent GPU. False: one rank trains as one process, unsharded.
    fsdp_one_rank: bool = False

    def validate(self):
        _number(self, "distributed", "timeout_s", low=0.0)
        _check(isinstance(self.fsdp_one_rank, bool), "distributed.fsdp_one_rank", "must be true or false",
               self.fsdp_one_rank)
        _check(self.timeout_s >= 4, "distributed.timeout_s", "must be >= 4 seconds", self.timeout_s)


@dataclasses.dataclass
class LoggingConfig:
    #: Experiment trackers that get every metric of metrics.jsonl at its step, the sample tables and curves.png
    #: (rank 0 only): any of tensorboard, wandb, swanlab, mlflow, trackio, each but tensorboard with its extra
    #: (pip install 'portarl[wandb]'); []: metrics.jsonl alone. Their settings: logging.<tracker> below; docs/trackers.md.
    trackers: list[str] = dataclasses.field(default_factory=lambda: ["tensorboard"])
    #: TensorBoard logs under <output_dir>/tensorboard, whatever logging.trackers says: true adds, false removes
    #: (the switch configs had before logging.trackers); null: as logging.trackers says.
    tensorboard: bool | None = None
    #: Progress bars on stderr (false: a log line every 10 steps instead).
    progress: bool = True
    #: Write curves.png (reward, accuracy, KL, grad norm) at the end.
    plot: bool = True
    #: Every this many steps (and at step 1): a few samples to samples.jsonl, the console
    #: and TensorBoard (0: never).
    samples_every: int = 10
    #: Rows written to samples.jsonl each time samples are logged.
    samples_count: int = 4
    wandb: WandbSection = dataclasses.field(default_factory=WandbSection)
    swanlab: SwanlabSection = dataclasses.field(default_factory=SwanlabSection)
    mlflow: MlflowSection = dataclasses.field(default_factory=MlflowSection)
    trackio: TrackioSection = dataclasses.field(default_factory=TrackioSection)

    def validate(self):
        for name in ("progress", "plot"):
            _check(isinstance(getattr(self, name), bool), f"logging.{name}", "must be true or false", getattr(self, name))
        _check(self.tensorboard is None or isinstance(self.tensorboard, bool), "logging.tensorboard",
               "must be true or false (or null: as logging.trackers says)", self.tensorboard)
        self.trackers = tracker_list(self.trackers)
        for name in SECTIONS:
            setattr(self, name, tracker_section(name, getattr(self, name)))
        _positive_int(self, "logging", "samples_every", "samples_count", allow_zero=True)

    def active_trackers(self) -> list[str]:
        """The trackers this run writes to: ``trackers`` with ``tensorboard``'s true / false
        applied (TensorBoard first, as the list's default puts it)."""
        names = [n for n in self.trackers if n != "tensorboard"]
        tensorboard = "tensorboard" in self.trackers if self.tensorboard is None else self.tensorboard
        return (["tensorboard"] if tensorboard else []) + names


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
    #: Rewards and their weights: functions {name, weight}, reward models {model: PATH, ...} and judges
    #: {judge: URL, model: NAME, ...}; see the rewards table below.
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
    #: The value model of loss.advantage_estimator=gae (PPO with a critic; docs/algorithms-menu.md).
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
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
                              ("shaping", self.shaping), ("reference", self.reference), ("eval", self.eval),
                              ("critic", self.critic)):
            _coerce_numbers(section, name)
            section.validate()
        validate_rewards(self.rewards)
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
        if self.loss.advantage_estimator != "gae" and not self.critic.is_default():
            raise ConfigError("critic settings are for loss.advantage_estimator=gae (PPO with a value model): set it, "
                              "or remove the critic section")
        if (self.loss.advantage_estimator == "gae" or self.loss.distill is not None) \
                and self.train.sequence_parallel_size > 1:
            raise ConfigError("per-token advantages (loss.advantage_estimator=gae, loss.distill) under sequence "
                              "parallelism are not supported yet: set train.sequence_parallel_size=1")
        if self.loss.advantage_estimator == "gae" and self.critic.warmup_steps >= self.train.steps:
            raise ConfigError(f"critic.warmup_steps ({self.critic.warmup_steps}) must be below train.steps "
                              f"({self.train.steps}): the policy would never update")
        if self.rollout.group_size < 2 and self.loss.advantage_estimator in ("grpo", "rloo"):
            raise ConfigError(f"rollout.group_size must be >= 2 for {self.loss.advantage_estimator} advantages, got {self.rollout.group_size}")
        return self

    # ---- dict / YAML round trip ----
    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["rewards"] = [spec.to_dict() for spec in self.rewards]  # unset fields of other kinds left out
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
                    raise ConfigError(f"rewards must be a list of {{name, weight}}, {{model: PATH}} or {{judge: URL, "
                                  f"model: NAME}}, got {value!r}")
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
        from_file = dict(values["data"]) if isinstance(values.get("data"), dict) else {}
        if path is not None:
            _judge_prompts_in(values.get("rewards"), path.resolve().parent)
        eval_from_file = dict(values["eval"]) if isinstance(values.get("eval"), dict) else {}
        for item in overrides or []:
            apply_override(values, item)
        config = cls.from_dict(values)
        # Not a field (never saved): where `module:function` rewards are also looked for.
        config.source_dir = str(Path(path).resolve().parent) if path is not None else None
        # A relative data.path (data.sft_path, eval.data) written in the file means the file's directory (as
        # for rewards), so a config runs from any working directory; one given by --set means the cwd.
        d = config.data
        for name in ("path", "sft_path"):
            value = getattr(d, name)
            if config.source_dir and value is not None and value == from_file.get(name) and not Path(value).is_absolute():
                setattr(d, name, str(Path(config.source_dir) / value))
        e = config.eval  # eval.data likewise
        if config.source_dir and e.data is not None and e.data == eval_from_file.get("data") and \
                not Path(e.data).is_absolute():
            e.data = str(Path(config.source_dir) / e.data)
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


def _judge_prompts_in(rewards, directory: Path) -> None:
    """A judge's relative ``prompt`` written in a config file means the file's directory
    (as ``data.path`` does) where such a file exists there."""
    for entry in rewards if isinstance(rewards, list) else ():
        prompt = entry.get("prompt") if isinstance(entry, dict) else None
        if isinstance(prompt, str) and not Path(prompt).is_absolute() and (directory / prompt).is_file():
            entry["prompt"] = str(directory / prompt)


_SECTION_CLASSES = {
    "model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig, "train": TrainSection,
    "optim": OptimConfig, "precision": PrecisionConfig, "guards": GuardsConfig,
    "checkpoint": CheckpointConfig, "distributed": DistributedConfig, "logging": LoggingConfig,
    "shaping": ShapingConfig, "reference": ReferenceConfig, "eval": EvalConfig, "critic": CriticConfig,
}
