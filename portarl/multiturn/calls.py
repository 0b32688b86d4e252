"""One call into a tool or an environment, as an outcome: its JSON value, or what went wrong.

Semantics, which differ from rewards on purpose: a tool or an environment is part of the
task the model is learning, so its failure is something the model sees (an error message in
the conversation) and the run counts (a metric), never a stopped run. A reward that fails
stops the run (:mod:`portarl.assets.reward_runner`): a wrong reward would train the wrong thing.

In this process (``rollout.tool_isolation: none``, the default), :func:`call_with_limit`
goes through :class:`portarl.runtime.user_code.UserCodeGuard`, the one guarded way into user code:
a call past ``rollout.tool_timeout_s`` is ended from inside (on the main thread a signal
ends a blocking sleep, read or wait too), ``sys.exit`` is caught like any exception, and a
stop signal (Ctrl-C, SIGTERM) that arrives during a call stops the run the documented way
instead of becoming a tool error. Native code that holds the interpreter and never returns
cannot be ended from inside a process: ``rollout.tool_isolation: process`` runs the same
calls in a child process (:mod:`portarl.multiturn.sandbox`, through :func:`run_captured`),
killed when a call hangs. Only JSON values come back, in both modes (a tool's result must
be ``json.dumps``-able, as it must be to cross the process boundary), so the two modes
accept and refuse the same tools.
"""

from __future__ import annotations

import dataclasses
import json
import time

from portarl.runtime.user_code import UserCodeError, describe


@dataclasses.dataclass
class CallOutcome:
    """What a call gave: ``ok`` and its JSON ``value``, or ``kind`` of failure (``raised``
    (``sys.exit`` included), ``timeout``, ``not_json``, ``lost``: its process died) and
    ``error``, one line that reads after the tool's name ("raised ValueError: ...")."""

    ok: bool
    value: object = None
    kind: str | None = None
    error: str | None = None
    elapsed_s: float = 0.0


def _as_json(value, started: float) -> CallOutcome:
    elapsed = time.perf_counter() - started
    try:
        return CallOutcome(True, json.loads(json.dumps(value, allow_nan=False)), elapsed_s=elapsed)
    except (TypeError, ValueError) as err:
        return CallOutcome(False, kind="not_json", elapsed_s=elapsed,
                           error=f"returned {type(value).__name__}, which is not JSON ({' '.join(str(err).split())})")


def call_with_limit(guard, fn, args: tuple = (), kwargs: dict | None = None, what: str | None = None) -> CallOutcome:
    """``fn(*args, **kwargs)`` through ``guard`` (a :class:`~portarl.runtime.user_code.UserCodeGuard`
    with ``rollout.tool_timeout_s``). Never raises for what ``fn`` does, except a stop
    signal that arrived during the call (``UserCodeError`` of kind ``interrupted``).
    ``what``: the call as a user names it ("tool 'search'"), for the run's flight recorder."""
    started = time.perf_counter()
    try:
        value = guard.call(fn, args, kwargs, what=what or getattr(fn, "__qualname__", "call"))
    except UserCodeError as err:
        if err.kind == "interrupted":  # the run stops (portarl.trainer.loop), not the tool
            raise
        return CallOutcome(False, kind="timeout" if err.kind == "timeout" else "raised", error=err.problem,
                           elapsed_s=time.perf_counter() - started)
    return _as_json(value, started)


def run_captured(fn, args: tuple, kwargs: dict) -> CallOutcome:
    """``fn(*args, **kwargs)`` with whatever it raises (``sys.exit`` too) as an outcome, no
    time limit: the tool process's call (its parent bounds it by killing the process)."""
    started = time.perf_counter()
    try:
        value = fn(*args, **kwargs)
    except BaseException as err:  # noqa: BLE001 - the child must answer whatever the user's code does
        return CallOutcome(False, kind="raised", error=describe(err)[1], elapsed_s=time.perf_counter() - started)
    return _as_json(value, started)


__all__ = ["CallOutcome", "call_with_limit", "run_captured"]
