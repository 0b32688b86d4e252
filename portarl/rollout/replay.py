"""Rollout pinning: record one run's rollouts and replay them to other runs.

Comparing two trainer settings on their own rollouts mixes sampling noise (different
numerics sample different tokens from the first step on) with numerical divergence.
Feeding every run the *same* rollouts, recorded from the first, leaves only the trainers'
numerics to differ: the method used in practice to align GPU and NPU runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from portarl.rollout.base import RolloutBatch, RolloutEngine, SamplingParams


class RecordingRollout(RolloutEngine):
    """Wraps an engine and keeps every batch it returns, in call order."""

    name = "recording"

    def __init__(self, inner: RolloutEngine):
        self.inner = inner
        self.batches: list[RolloutBatch] = []

    def generate(self, prompts, seeds, params: SamplingParams) -> RolloutBatch:
        batch = self.inner.generate(prompts, seeds, params)
        self.batches.append(batch)
        return batch

    def sync_weights(self, model) -> None:
        self.inner.sync_weights(model)

    def mark_trainer_updated(self) -> None:
        self.inner.mark_trainer_updated()

    def sleep(self) -> None:
        self.inner.sleep()

    def close(self) -> None:
        self.inner.close()

    def save(self, path: str | Path) -> None:
        torch.save([b.__dict__ for b in self.batches], path)


class ReplayRollout(RolloutEngine):
    """Returns recorded batches in order; refuses prompts that differ from the recording."""

    name = "replay"

    def __init__(self, batches: list[RolloutBatch]):
        self.batches = list(batches)
        self.position = 0

    @classmethod
    def load(cls, path: str | Path) -> "ReplayRollout":
        return cls([RolloutBatch(**d) for d in torch.load(path, weights_only=False)])

    def generate(self, prompts, seeds, params: SamplingParams) -> RolloutBatch:
        if self.position >= len(self.batches):
            raise RuntimeError(f"replay exhausted after {len(self.batches)} recorded rollouts; record a longer run")
        batch = self.batches[self.position]
        if [list(p) for p in prompts] != batch.prompt_ids:
            raise RuntimeError(
                f"replayed rollout {self.position + 1} was recorded for different prompts: runs must share "
                "data, seed and prompts_per_step"
            )
        self.position += 1
        return batch
