"""The ``rewards`` list: one :class:`RewardSpec` per reward, of three kinds, summed with
their weights (:mod:`portarl.assets.reward_runner`):

- a function: ``{name: math_exact | format | environment | module:function, weight}``;
- a discriminative reward model: ``{model: PATH, name, weight, device, dtype, batch_size}``
  (:mod:`portarl.assets.reward_models`);
- a generative judge behind an OpenAI-compatible server: ``{judge: URL, model: NAME,
  prompt: FILE, parse, concurrency, rate_limit, timeout_s, retries, name, weight}``
  (:mod:`portarl.assets.judges`).

Settings of one kind on another are refused (a ``batch_size`` on a judge would be silently
ignored otherwise); so are two rewards of one name (their metrics, ``reward/<name>``, and
their columns in the samples would collide).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from portarl.trainer.config.fields import ConfigError, _check, _coerce_numbers, _number, _positive_int

MODEL_FIELDS = ("device", "dtype", "batch_size")
JUDGE_FIELDS = ("prompt", "parse", "concurrency", "rate_limit", "timeout_s", "retries", "max_tokens")
PARSE_RULES = ("number", "first_number", "last_number")


@dataclasses.dataclass
class RewardSpec:
    #: Built-in ("math_exact", "format", "environment") or "module:function"; with `model` or `judge`: the
    #: reward's name in the metrics (reward/<name>) and samples (default: the model directory's name, or
    #: judge_<model>).
    name: str | None = None
    #: Its factor in the sum of rewards (a sample's reward is the weighted sum of every reward's value).
    weight: float = 1.0
    #: A reward model: the directory of a transformers sequence-classification model with one label (its
    #: own tokenizer and chat template). With `judge`: the model name the server serves.
    model: str | None = None
    #: A generative judge: the URL of an OpenAI-compatible server (POST URL/v1/chat/completions; a URL ending
    #: in /chat/completions is used as given).
    judge: str | None = None
    #: Reward model: its device (default: the device of the process that scores: the trainer's rank, or the
    #: async worker's).
    device: str | None = None
    #: Reward model: "bf16" or "fp32" (default: precision.dtype, fp32 for fp16).
    dtype: str | None = None
    #: Reward model: samples per forward (default 8).
    batch_size: int | None = None
    #: Judge: a text file, the user message sent for each sample; {prompt}, {completion} and {answer} are
    #: replaced (no other braces are touched). Default: a built-in 0-10 rating prompt.
    prompt: str | None = None
    #: Judge: how the score is read from the reply: "number" / "first_number" (the first number in it),
    #: "last_number", or "module:function" (fn(reply_text) -> float). Default "number".
    parse: str | None = None
    #: Judge: requests in flight at once, per process (under torchrun: per rank). Default 4.
    concurrency: int | None = None
    #: Judge: most requests started per second, per process (under torchrun: per rank). Default: no limit.
    rate_limit: float | None = None
    #: Judge: seconds one request may take. Default 60.
    timeout_s: float | None = None
    #: Judge: tries after the first failed one, with exponential backoff and jitter. Default 2.
    retries: int | None = None
    #: Judge: most tokens of a reply (the request's max_tokens). Default: the server's.
    max_tokens: int | None = None

    @property
    def kind(self) -> str:
        return "judge" if self.judge is not None else "model" if self.model is not None else "function"

    def to_dict(self) -> dict:
        """The fields that are set (what a config file holds; unset ones are left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def validate(self, where: str) -> None:
        _coerce_numbers(self, where)
        _check(isinstance(self.weight, (int, float)) and not isinstance(self.weight, bool)
               and math.isfinite(self.weight), f"{where}.weight", "must be a finite number", self.weight)
        kind = self.kind
        foreign = [f for f in (MODEL_FIELDS if kind != "model" else ()) + (JUDGE_FIELDS if kind != "judge" else ())
                   if getattr(self, f) is not None]
        if foreign:
            owner = "a reward model's (model: PATH)" if foreign[0] in MODEL_FIELDS else "a judge's (judge: URL)"
            raise ConfigError(f"{where}.{foreign[0]} is {owner} setting, and this reward is a {kind}; remove it")
        if kind == "function":
            _check(isinstance(self.name, str) and bool(self.name), f"{where}.name",
                   "must be a string (a built-in or module:function), or set model: PATH or judge: URL", self.name)
            return
        _check(self.name is None or isinstance(self.name, str) and bool(self.name), f"{where}.name",
               "must be a non-empty string", self.name)
        _check(isinstance(self.model, str) and bool(self.model), f"{where}.model",
               "must name the reward model's directory (or, with judge, the served model)", self.model)
        if kind == "model":
            self._validate_model(where)
        else:
            self._validate_judge(where)

    def _validate_model(self, where: str) -> None:
        if self.name is None:
            self.name = Path(self.model.rstrip("/")).name or self.model
        _check(self.dtype in (None, "bf16", "fp32"), f"{where}.dtype", "must be bf16 or fp32", self.dtype)
        _check(self.device is None or isinstance(self.device, str) and bool(self.device), f"{where}.device",
               "must be a device such as cpu, cuda:1 or npu:0", self.device)
        if self.batch_size is not None:
            _positive_int(self, where, "batch_size")

    def _validate_judge(self, where: str) -> None:
        _check(isinstance(self.judge, str) and self.judge.startswith(("http://", "https://")), f"{where}.judge",
               "must be an http:// or https:// URL of an OpenAI-compatible server", self.judge)
        if self.name is None:
            self.name = f"judge_{self.model}"
        if self.parse is not None:
            _check(isinstance(self.parse, str) and (self.parse in PARSE_RULES or ":" in self.parse), f"{where}.parse",
                   f"must be {', '.join(PARSE_RULES)} or module:function", self.parse)
        for name in ("concurrency", "retries", "max_tokens"):
            if getattr(self, name) is not None:
                _positive_int(self, where, name, allow_zero=name == "retries")
        for name in ("rate_limit", "timeout_s"):
            _number(self, where, name, low=0.0, allow_none=True)
        if self.prompt is not None:
            _check(isinstance(self.prompt, str) and bool(self.prompt), f"{where}.prompt", "must be a file path",
                   self.prompt)
            path = Path(self.prompt)  # a relative one written in a config file: TrainConfig.load made it the file's
            _check(path.is_file(), f"{where}.prompt", "must be a text file (the judge's prompt template)", self.prompt)
            self.prompt = str(path.resolve())


def default_rewards() -> list[RewardSpec]:
    return [RewardSpec("math_exact", 1.0), RewardSpec("format", 0.1)]


def validate_rewards(rewards: list) -> None:
    """Each spec's own checks, then: at least one, and no two of one name."""
    _check(bool(rewards), "rewards", "must list at least one reward", rewards)
    seen: dict[str, int] = {}
    for i, spec in enumerate(rewards):
        spec.validate(f"rewards[{i}]")
        if spec.name in seen:
            raise ConfigError(f"rewards[{i}].name {spec.name!r} is also rewards[{seen[spec.name]}]'s: give each "
                              "reward its own name (its metric is reward/<name>)")
        seen[spec.name] = i
