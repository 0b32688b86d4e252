"""The prompts a GRPO step trains on: ``train.prompts_per_step`` examples drawn by (run seed,
step), so a resumed run and every rank draw the same ones. Below the rollout phase, dynamic
sampling and the async pipeline, which all start from them."""

from __future__ import annotations

import random

from portarl.assets.data import Example


def prompts_for_step(trainer, step: int) -> list[Example]:
    rng = random.Random(f"{trainer.config.train.seed}/prompts/{step}")
    n = trainer.config.train.prompts_per_step
    return rng.sample(trainer.examples, n) if n <= len(trainer.examples) else [rng.choice(trainer.examples) for _ in range(n)]
