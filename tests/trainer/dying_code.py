"""User code that ends its process the ways no exception handler sees (imported via
PYTHONPATH as ``dying_code:<name>``): ``$DIE`` is ``exit0`` / ``exit7`` (``os._exit(0)`` /
``os._exit(7)``) or ``segv`` (a read of address 0: a segfault); ``$DIE_AFTER`` calls pass
first (0 by default); ``$DIE_RANK``: only that torchrun rank dies."""

import ctypes
import os

_calls = [0]


def _maybe_die() -> None:
    _calls[0] += 1
    if _calls[0] <= int(os.environ.get("DIE_AFTER", "0")):
        return
    if os.environ.get("DIE_RANK") not in (None, os.environ.get("RANK", "0")):
        return
    how = os.environ.get("DIE", "exit0")
    if how == "segv":
        ctypes.string_at(0)
    os._exit(int(how[len("exit"):]))


def reward(prompt, completion, answer):
    _maybe_die()
    return float(len(completion) % 3)


def batched_zero(prompts, completions, **columns):
    """A reward that never dies (the tool and environment runs need one)."""
    return [0.0] * len(prompts)


def leave_now() -> str:
    """End the process."""
    _maybe_die()
    return "still here"


class DyingEnv:
    def reset(self, row):
        _maybe_die()
        return None

    def step(self, message):
        return {"observation": None, "done": True, "reward": 0.0}
