"""Rewards that misbehave the ways a user's code can (imported by the trainer via PYTHONPATH,
as ``faulty_rewards:<name>``): exit, interrupt, hang, return NaN. The first call of a run
passes (a step finishes and is checkpointed first) when ``$FAULT_AFTER`` says how many calls
to let through; ``$HOLD_DIR/holding`` is created when a hang starts."""

import os
import sys
import threading
from pathlib import Path

#: A hang ends by itself after this long: far beyond any time limit a test sets, so a
#: working guard ends it first on any machine load, while a broken one fails the test.
HANG_S = 600.0

_calls = [0]


def _varied(completion: str) -> float:
    """Different values within a group (trainer_fast.varied_reward): steps that pass learn."""
    return float(sum(map(ord, completion)) % 5)


def _due() -> bool:
    _calls[0] += 1
    return _calls[0] > int(os.environ.get("FAULT_AFTER", "0"))


class OddBase(BaseException):
    pass


def exits_0(prompt, completion, answer):
    if _due():
        sys.exit(0)
    return _varied(completion)


def exits_1(prompt, completion, answer):
    if _due():
        sys.exit(1)
    return _varied(completion)


def keyboard_interrupt(prompt, completion, answer):
    if _due():
        raise KeyboardInterrupt
    return _varied(completion)


def base_exception(prompt, completion, answer):
    if _due():
        raise OddBase("from a reward")
    return _varied(completion)


def hangs(prompt, completion, answer):
    if _due():
        if "HOLD_DIR" in os.environ:
            (Path(os.environ["HOLD_DIR"]) / "holding").touch()
        threading.Event().wait(HANG_S)
    return _varied(completion)


def nan(prompt, completion, answer):
    return float("nan") if _due() else _varied(completion)


def two_args(prompt, completion):
    return 0.0
