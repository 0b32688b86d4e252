"""Environments that fail some or all of their episodes, and environment factories the
checks before the model loads must refuse or call once (stdlib only, as agent_tools.py:
the tool process of ``rollout.tool_isolation: process`` imports them too)."""

from __future__ import annotations

import time

from agent_tools import CountEnv


class _EverySecond(CountEnv):
    """Every second instance of each subclass is broken (half the episodes of a step)."""

    made = 0

    def __init__(self):
        type(self).made += 1
        self.broken = type(self).made % 2 == 0


class FlakyEnv(_EverySecond):
    """Half the episodes' ``step`` raises."""

    def step(self, message):
        if self.broken:
            raise RuntimeError("flaky step")
        return super().step(message)


class FlakyResetEnv(_EverySecond):
    """Half the episodes' ``reset`` raises: they fail before their first turn."""

    def reset(self, row):
        if self.broken:
            raise RuntimeError("flaky reset")
        return super().reset(row)


class UnclosableEnv:
    """Done after one reply with reward 1; its ``close`` raises."""

    def reset(self, row):
        return None

    def step(self, message):
        return {"observation": None, "done": True, "reward": 1.0}

    def close(self):
        raise OSError("cannot close")


class NoStepEnv:
    def reset(self, row):
        return None


class SizedEnv(CountEnv):
    def __init__(self, size):
        self.size = size


def make_none():
    """A factory function that forgot its return."""
    CountEnv()


#: What make_counted made and closed (the check before the model loads calls it once).
COUNTED = {"made": 0, "closed": 0}


class _Counted(CountEnv):
    def close(self):
        COUNTED["closed"] += 1


def make_counted():
    COUNTED["made"] += 1
    return _Counted()


def make_slowly():
    time.sleep(60)  # past rollout.tool_timeout_s: named by the check, not waited for
    return CountEnv()
