"""One call into user code (a tool, an environment method) with a time limit, in this process.

Semantics, which differ from rewards on purpose: a tool or an environment is part of the
task the model is learning, so its failure is something the model sees (an error message in
the conversation) and the run counts (a metric), never a stopped run. A reward that fails
stops the run (:mod:`portarl.reward_runner`): a wrong reward would train the wrong thing.

:func:`call_with_limit` is the one place a tool or environment call runs in this process
(``rollout.tool_isolation: thread``, the default); ``process`` isolation runs the same calls
in a child process (:mod:`portarl.multiturn.sandbox`). It is kept to one small
function so that a shared runner for every call into user code can replace its body.

Why a thread: Python cannot interrupt arbitrary code from outside (a signal reaches only
the main thread and not C code), so the call runs on a daemon thread of its own and the
caller waits at most ``timeout_s``. A call still running then is *abandoned*: its result is
ignored, it keeps its thread until it returns, and :func:`abandoned_calls` counts it (the
episode runner reports it as an event naming ``rollout.tool_isolation: process``, where a
hung call is killed with its process). Only JSON values come back: a tool's result must be
``json.dumps``-able, as it must be to cross the process boundary in ``process`` mode, so the
two modes accept and refuse the same tools.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

_abandoned = 0
_abandoned_lock = threading.Lock()


@dataclasses.dataclass
class CallOutcome:
    """What a call gave: ``ok`` and its JSON ``value``, or ``kind`` of failure (``raised``,
    ``timeout``, ``not_json``, ``lost``: its process died) and a one-line ``error``."""

    ok: bool
    value: object = None
    kind: str | None = None
    error: str | None = None
    elapsed_s: float = 0.0


def one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_value(value):
    """``value`` as plain JSON (what a process boundary would carry), or TypeError / ValueError."""
    return json.loads(json.dumps(value, allow_nan=False))


def run_captured(fn, args: tuple, kwargs: dict) -> CallOutcome:
    """``fn(*args, **kwargs)`` with its exception or a non-JSON result as an outcome (no time
    limit: the caller bounds it). Shared by this module's thread and the sandbox process."""
    started = time.perf_counter()
    try:
        value = fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure of user code is an outcome, not a crash
        return CallOutcome(False, kind="raised", error=one_line(f"{type(err).__name__}: {err}"),
                           elapsed_s=time.perf_counter() - started)
    elapsed = time.perf_counter() - started
    try:
        return CallOutcome(True, json_value(value), elapsed_s=elapsed)
    except (TypeError, ValueError) as err:
        return CallOutcome(False, kind="not_json", error=one_line(f"returned {type(value).__name__}, which is not "
                                                                  f"JSON ({err})"), elapsed_s=elapsed)


def call_with_limit(fn, args: tuple = (), kwargs: dict | None = None, *, timeout_s: float) -> CallOutcome:
    """``fn(*args, **kwargs)`` on a thread of its own, waited for at most ``timeout_s``
    seconds. Never raises for what ``fn`` does (see the module docstring)."""
    box: list[CallOutcome] = []
    done = threading.Event()

    def run():
        box.append(run_captured(fn, args, kwargs or {}))
        done.set()

    started = time.perf_counter()
    thread = threading.Thread(target=run, name=f"portarl-call-{getattr(fn, '__name__', 'user')}", daemon=True)
    thread.start()
    if done.wait(timeout_s):
        thread.join()
        return box[0]
    global _abandoned
    with _abandoned_lock:
        _abandoned += 1
    return CallOutcome(False, kind="timeout", error=f"did not return within {timeout_s:g} s (rollout.tool_timeout_s)",
                       elapsed_s=time.perf_counter() - started)


def abandoned_calls() -> int:
    """How many calls of this process were left running after their time limit."""
    return _abandoned


__all__ = ["CallOutcome", "abandoned_calls", "call_with_limit", "json_value", "one_line", "run_captured"]
