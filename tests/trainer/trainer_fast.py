"""Fast trainer settings shared by the trainer tests (a plain module: several conftest.py
files exist, so ``from conftest import`` would be ambiguous)."""

from __future__ import annotations

FAST = [
    "train.steps=3",
    "train.prompts_per_step=4",
    "train.sft_warmup_steps=0",
    "train.micro_batch_size=8",
    "rollout.group_size=4",
    "rollout.max_new_tokens=3",
    "data.synthetic_size=64",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "optim.lr=1e-3",
]


def fast_config(tmp_path, *overrides: str):
    """The config of ``FAST`` plus ``overrides``, writing under ``tmp_path`` (portarl.trainer is
    imported here, not at the top: async workers import this module for its rewards)."""
    from portarl.trainer import TrainConfig

    return TrainConfig.load(None, [*FAST, f"output_dir={tmp_path / 'run'}", *overrides])


def varied_reward(prompt, completion, answer):
    """A reward that differs between the samples of a group from the first step on: it
    depends on every character of the completion, so (with the 79-token character
    vocabulary) G random completions almost surely get different values. The tests that
    need a first-step gradient use it; the demo's own rewards are 0 for every sample of an
    untrained model, and a completion's length is the same for all of them whenever no
    sample happens to stop early."""
    return float(sum(map(ord, completion)) % 5)



def global_rng_reward(prompt, completion, answer):
    """A reward that draws from Python's, NumPy's and torch's global generators, as user
    code does (exploration bonuses, sampled judges): reproducible only if the run seeds them."""
    import random

    import numpy as np
    import torch

    return random.random() + float(np.random.rand()) + float(torch.rand(()))
