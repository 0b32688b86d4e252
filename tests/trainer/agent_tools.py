"""Tools and environments for the multi-turn tests: stdlib only, so the tool process of
``rollout.tool_isolation: process`` starts in a fraction of a second."""

from __future__ import annotations

import os
import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b  # b = 0 raises ZeroDivisionError: the model must get it as a message


def wait(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)  # past rollout.tool_timeout_s: a hung tool
    return "woke"


def leave() -> str:
    """Call sys.exit(3)."""
    raise SystemExit(3)


def pid() -> int:
    """The id of the process the tool runs in."""
    return os.getpid()


def crash() -> str:
    """Take the interpreter down (a segfaulting C extension, say)."""
    os._exit(3)


def reward_env_text(prompts, completions, conversation, **columns):
    """A batched reward that reads the conversation column (multi-turn episodes add it)."""
    return [float(sum(m["role"] == "assistant" for m in conv)) for conv in conversation]


class CountEnv:
    """Answers every reply with "again" until the third, then is done; reward: replies seen."""

    def reset(self, row):
        self.replies = 0
        return None

    def step(self, message):
        self.replies += 1
        if self.replies >= 3:
            return {"observation": None, "done": True, "reward": float(self.replies)}
        return "again"


class BrokenEnv(CountEnv):
    def step(self, message):
        raise RuntimeError("the environment broke")


class GreetEnv:
    """Adds "Say hello." to the prompt; done after one reply, reward 1 if it said hello."""

    def reset(self, row):
        return "Say hello."

    def step(self, message):
        self.said = message
        return None

    def get_reward(self):
        return 1.0 if "hello" in self.said else 0.0


class PidEnv:
    """Tells the model which process it runs in (the async worker's, not the trainer's)."""

    def reset(self, row):
        return None

    def step(self, message):
        return {"observation": f"pid {os.getpid()}", "done": False, "reward": 1.0}


class LongResetEnv(CountEnv):
    """Appends more text to the prompt than the model's context holds."""

    def reset(self, row):
        super().reset(row)
        return "x" * 5000
