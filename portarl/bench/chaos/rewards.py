"""The chaos run's reward: deterministic, different between the samples of a group (so the
weights move from the first step), and able to raise once on demand.

``reward_raises`` puts a file ``reward_raises`` in the chaos directory (``PORTARL_CHAOS_DIR``);
the next call that finds it removes it and raises, as user code that fails once would. Used
as ``portarl.bench.chaos.rewards:varied`` (in the async worker's process too)."""

from __future__ import annotations

import os

from portarl.trainer.run.write_failure import CHAOS_DIR_ENV


class ChaosRewardError(RuntimeError):
    """The chaos schedule's reward fault."""


def varied(prompt, completion, answer):
    chaos = os.environ.get(CHAOS_DIR_ENV)
    if chaos:
        try:
            os.unlink(os.path.join(chaos, "reward_raises"))
        except FileNotFoundError:
            pass
        else:
            raise ChaosRewardError("chaos: the reward function raises once (reward_raises)")
    return float(sum(map(ord, completion)) % 5)


__all__ = ["ChaosRewardError", "varied"]
