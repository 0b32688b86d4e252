"""A chaos run's faults, drawn from one seed: which kind, after which step, how long after it.

Every fault waits until the running launch logs its step in ``metrics.jsonl`` and then a
fraction ``delay`` of a step more (of the uninterrupted run's measured seconds per step), so it
lands anywhere inside a later step: a rollout, a scoring, an update, a checkpoint write.
A ``start_up`` fault instead strikes the first launch that starts at or after its step,
``delay`` of the measured start-up time after the launch (imports, model build, resume).
Faults are taken in order of their step; one whose step a launch has passed fires at once.
"""

from __future__ import annotations

import dataclasses
import random

#: What a fault does (see :mod:`portarl.bench.chaos.inject`):
KINDS = {
    "sigkill_trainer": "SIGKILL of the training process (rank 0's under torchrun), as the OOM killer would",
    "sigterm_job": "SIGTERM of the whole job, as a scheduler's preemption: a checkpoint, then exit 143",
    "sigkill_rank": "SIGKILL of one torchrun rank (rank 1) while the others run on",
    "sigkill_worker": "SIGKILL of the async rollout worker",
    "disk_full_checkpoint": "ENOSPC at the next checkpoint write, once its bytes are down",
    "disk_full_weights": "ENOSPC at the next weight publish (rollout.weight_sync: file)",
    "judge_outage": "the judge server answers 503 for a while (the judge's retries may ride it out)",
    "reward_raises": "the reward function raises once",
}


@dataclasses.dataclass
class Fault:
    index: int
    kind: str
    after_step: int
    #: a fraction of a step (of the start-up, for a start_up fault)
    delay: float
    start_up: bool = False
    #: judge_outage: how long the judge stays down
    duration_s: float = 0.0

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def make_schedule(seed: int, count: int, steps: int, kinds: list[str], *, start_up_share: float = 0.15) -> list[Fault]:
    """``count`` faults over a run of ``steps`` steps, each kind in ``kinds`` at least once
    when ``count`` allows, the rest drawn uniformly; a ``start_up_share`` of them during a
    launch's start-up, the others after a step drawn from 1 .. ``steps`` - 1 (so the run
    always has a step left to fail in). The same seed gives the same schedule."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}: choose from {', '.join(KINDS)}")
    if count < 0 or steps < 2:
        raise ValueError(f"a chaos schedule needs count >= 0 and steps >= 2, got count={count}, steps={steps}")
    rng = random.Random(seed)
    chosen = list(kinds[:count]) + [rng.choice(kinds) for _ in range(count - min(count, len(kinds)))]
    rng.shuffle(chosen)
    early = [rng.random() < start_up_share and kind not in ("judge_outage", "reward_raises") for kind in chosen]
    at = [rng.randint(1, max(1, steps // 2)) if first else rng.randint(1, steps - 1) for first in early]
    order = sorted(range(len(chosen)), key=lambda i: at[i])
    return [Fault(n, chosen[i], at[i], delay=round(rng.random(), 3), start_up=early[i],
                  duration_s=round(rng.uniform(0.5, 4.0), 3) if chosen[i] == "judge_outage" else 0.0)
            for n, i in enumerate(order)]


__all__ = ["KINDS", "Fault", "make_schedule"]
