"""A policy, its tokenizer and the training rows as a :class:`TrainConfig` names them (the
CLI's and the benchmarks' way in; a library user may build them any other way and hand
them to :class:`portarl.trainer.grpo.GRPOTrainer`)."""

from __future__ import annotations

from portarl.assets.data import Example, arithmetic_examples, load_examples_for
from portarl.trainer.config import TrainConfig


def build_from_config(config: TrainConfig):
    """``(model, tokenizer, examples)`` as the config names them (built-in tiny model and
    synthetic arithmetic by default)."""
    model, tokenizer = build_policy(config)
    return model, tokenizer, build_examples(config)


def build_policy(config: TrainConfig):
    """``(model, tokenizer)`` as ``config.model`` names them, in ``precision.dtype``."""
    from portarl.assets.models import build_model
    from portarl.trainer.guards.precision import DTYPES

    return build_model(config.model, DTYPES[config.precision.dtype])


def build_examples(config: TrainConfig) -> list[Example]:
    """The training rows: ``data.path`` loaded, or the built-in synthetic arithmetic."""
    d = config.data
    if d.path is None:
        return arithmetic_examples(d.synthetic_size, seed=config.train.seed, max_operand=d.max_operand, ops=d.operators)
    return load_examples_for(d)


__all__ = ["build_examples", "build_from_config", "build_policy"]
