"""The training-config sections of the optional algorithm pieces: ``shaping`` (DAPO's soft
overlong punishment, TRL's truncated-completion masking), ``reference`` (syncing the KL
reference toward the policy) and ``eval`` (held-out evaluation during training).
Re-exported by :mod:`portarl.trainer.config`. Each is off by default."""

from __future__ import annotations

import dataclasses

from portarl.trainer.config.fields import _check, _number, _positive_int

#: Why reference.sync is refused with LoRA (the config check and the trainer's, for a model
#: passed in with adapters).
REFERENCE_SYNC_LORA = ("reference.sync with LoRA: the reference is the base model with the adapter switched off (no "
                       "copy of the weights), so there is nothing to mix the policy into; train without LoRA to sync "
                       "the reference, or set reference.sync=false")


@dataclasses.dataclass
class ShapingConfig:
    #: DAPO soft overlong punishment (verl's reward_model.overlong_buffer.len): a completion
    #: longer than rollout.max_new_tokens - overlong_buffer tokens gets a reward penalty
    #: growing linearly to -overlong_penalty_factor at max_new_tokens. 0: off.
    overlong_buffer: int = 0
    #: The penalty at max_new_tokens (verl's overlong_buffer.penalty_factor).
    overlong_penalty_factor: float = 1.0
    #: TRL's mask_truncated_completions: completions that hit max_new_tokens without an end
    #: token leave the loss (their rewards still count in their group's advantages).
    mask_truncated_completions: bool = False

    def validate(self):
        _positive_int(self, "shaping", "overlong_buffer", allow_zero=True)
        _number(self, "shaping", "overlong_penalty_factor", low=0.0, strict=False)
        _check(isinstance(self.mask_truncated_completions, bool), "shaping.mask_truncated_completions",
               "must be true or false", self.mask_truncated_completions)


@dataclasses.dataclass
class ReferenceConfig:
    #: TRL's sync_ref_model (TR-DPO, arXiv 2404.09656): every sync_steps GRPO iterations the
    #: KL reference becomes mixup_alpha * policy + (1 - mixup_alpha) * reference. Full models
    #: only: with LoRA the reference is the base model with the adapter off, and is refused.
    sync: bool = False
    #: TRL's ref_model_mixup_alpha.
    mixup_alpha: float = 0.6
    #: TRL's ref_model_sync_steps, counted in GRPO iterations (train steps).
    sync_steps: int = 512

    def validate(self):
        _check(isinstance(self.sync, bool), "reference.sync", "must be true or false", self.sync)
        _number(self, "reference", "mixup_alpha", low=0.0)
        _check(self.mixup_alpha <= 1, "reference.mixup_alpha", "must be in (0, 1]", self.mixup_alpha)
        _positive_int(self, "reference", "sync_steps")


@dataclasses.dataclass
class EvalConfig:
    #: Held-out JSONL / Parquet file (data.prompt_field / data.answer_field), scored with the
    #: training rewards. None: no evaluation during training.
    data: str | None = None
    #: Evaluate every this many GRPO iterations (and after the last one).
    every: int = 50
    #: Completions per prompt (eval/pass@n and eval/reward/mean over all of them).
    n: int = 1
    #: True: greedy decoding (n must be 1); false: sample at rollout.temperature with seeds
    #: fixed per (prompt, sample), the same at every evaluation.
    greedy: bool = True
    #: At most this many prompts of eval.data (0: all).
    max_prompts: int = 0
    #: Keep the checkpoint with the best value of this metric under checkpoints/best
    #: (None: none kept). Higher is better.
    best_metric: str | None = "eval/reward/mean"

    def validate(self):
        _check(self.data is None or (isinstance(self.data, str) and bool(self.data)), "eval.data",
               "must be a file path or null", self.data)
        _positive_int(self, "eval", "every", "n")
        _positive_int(self, "eval", "max_prompts", allow_zero=True)
        _check(isinstance(self.greedy, bool), "eval.greedy", "must be true or false", self.greedy)
        _check(not (self.greedy and self.n > 1), "eval.n", "must be 1 with eval.greedy=true (greedy samples are "
               "identical); set eval.greedy=false to sample n", self.n)
        _check(self.best_metric is None or (isinstance(self.best_metric, str) and self.best_metric.startswith("eval/")),
               "eval.best_metric", "must name an eval/* metric or be null", self.best_metric)
