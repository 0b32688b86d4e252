"""Stateful environments: ``environment: "mymodule:make_env"`` in the config.

The protocol (one environment instance per episode, made by calling the factory)::

    class GuessEnv:
        def reset(self, row: dict) -> str | None:
            # ``row``: the data row (every column, the prompt included). A string returned
            # is appended to the prompt's last user message (TRL's environment_factory does
            # the same); None leaves the prompt as it is.
        def step(self, message: str):
            # ``message``: the model's reply (its text, special tokens removed). Returns
            #   a string             -> the next user message (the episode goes on);
            #   None                 -> the episode is done;
            #   (observation, done) or (observation, done, reward);
            #   {"observation": str | None, "done": bool, "reward": float | None,
            #    "role": "user" | "tool"}.
        def get_reward(self) -> float:   # optional: the episode's reward, asked once at its end
        def close(self):                 # optional

``environment`` may also be a mapping ``{name: "module:factory"}``: each data row then names
its environment in an ``environment`` column (TRL's dict ``environment_factory``).

Checked before the model loads (:mod:`portarl.trainer.start.preflight`, ``portarl train``): each factory
must be callable with no arguments, a class must define ``reset`` and ``step``
(:func:`load_factories`: nothing is made), a factory *function* is called once to see what
it returns (:func:`probe_factory`: an object with ``reset`` and ``step``, not None), and with
a mapping every data row must name one of its environments (:func:`check_rows`).

The episode's environment reward, ``get_reward()`` when the environment defines it (and it
returns a number), else the sum of the rewards its ``step`` calls returned (0.0 when none
did, e.g. an episode cut at ``rollout.max_turns`` before a final step), is the column
``env_reward`` of each sample, which the built-in reward ``environment`` returns
(``rewards: [{name: environment}]``): the environment owns the reward. An environment that
raises, hangs or returns something else ends its episode with an error message in the
conversation and ``agent/env_errors``, and its env reward is 0.0. An environment that fails
every one of its episodes of a training step stops the run (exit 3, naming it):
:func:`portarl.multiturn.report.broken_environment`.
"""

from __future__ import annotations

import inspect
import math

from portarl.multiturn.tools import load_object
from portarl.runtime.user_code import UserCodeError, UserCodeGuard, arity_problem

ROW_FIELD = "environment"


def load_factories(spec, search_dirs=()) -> dict[str | None, object]:
    """``{name: factory}`` (name None for a single environment) from the config's ``environment``,
    each checked without being called (:func:`check_factory`)."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        items = {None: spec}
    elif isinstance(spec, dict) and spec:
        items = dict(spec)
    else:
        raise ValueError(f"environment must be 'module:factory' or a mapping of names to them, got {spec!r}")
    out = {}
    for name, target in items.items():
        setting = setting_of(name)
        factory = load_object(target, search_dirs, setting)
        check_factory(factory, f"{setting}: {target!r}")
        out[name] = factory
    return out


def setting_of(name: str | None) -> str:
    """The config field naming environment ``name`` (None: the single one)."""
    return "environment" if name is None else f"environment.{name}"


def check_factory(factory, what: str) -> None:
    """Refuse a factory that cannot make an environment, without calling it: one that is not
    callable or needs arguments (portarl calls it with none), or a class without ``reset``
    or ``step``. ``what``: how the message names it (``environment: 'games:GuessEnv'``)."""
    if not callable(factory):
        raise ValueError(f"{what} is not callable (a class or a function returning an environment)")
    problem = arity_problem(factory, (), "none")
    if problem is not None:
        raise ValueError(f"{what} {problem} (the factory is called with no arguments: bind them with "
                         "functools.partial, or read them from the data row in reset)")
    if inspect.isclass(factory):
        check_environment(factory, what)


def probe_factory(factory, what: str, timeout_s: float | None) -> None:
    """Call a factory that is not a class once, as an episode would, and refuse what it
    returns unless that is an environment (None included); the object is closed (its
    ``close()``, when it has one) and dropped. Every call goes through the user-code guard
    with ``rollout.tool_timeout_s``: a factory that raises, exits or hangs is named."""
    if inspect.isclass(factory):
        return  # check_factory read its methods; nothing is made
    with UserCodeGuard(timeout_s, "rollout.tool_timeout_s") as guard:
        try:
            env = guard.call(factory, (), what="the factory")
            check_made(env, what)
            close = getattr(env, "close", None)
            if callable(close):
                guard.call(close, (), what=f"the close() of the {type(env).__name__} it returned")
        except UserCodeError as err:
            raise ValueError(f"{what}: {err} (portarl calls a factory function once before the model loads, to see "
                             "what it returns)") from None


def _row_problem(row: dict, names) -> str | None:
    """Why ``row`` does not name one of the mapping's environments ``names``, or None."""
    listed = ", ".join(map(repr, names))
    if ROW_FIELD not in row:
        return (f"the data row has no {ROW_FIELD!r} column, and the config's environment is a mapping ({listed}): "
                f"each row names its environment in that column (or set environment: module:factory, one for every "
                "row)")
    name = row[ROW_FIELD]
    if name not in names:
        return f"the data row names environment {name!r} in its {ROW_FIELD!r} column; the config's environment " \
               f"mapping has {listed}"
    return None


def environment_of(row: dict, names) -> str | None:
    """Which environment a data row names (None: the single one)."""
    if list(names) == [None]:
        return None
    problem = _row_problem(row, names)
    if problem is not None:
        raise ValueError(problem)
    return row[ROW_FIELD]


def check_rows(examples, names, what: str = "data") -> None:
    """With a mapping (``names``: its names; ``[None]`` for a single environment, ``[]`` for
    none), every row of ``examples`` (its ``columns``) must name one of its environments; the
    first that does not is named (``file:line``)."""
    names = list(names)
    if names in ([], [None]):
        return
    for i, ex in enumerate(examples):
        problem = _row_problem(ex.columns, names)
        if problem is not None:
            raise ValueError(f"{ex.where or f'{what} row {i}'}: {problem}")


def check_made(env, what: str) -> None:
    """What a factory returned is an environment (None is named as such)."""
    if env is None:
        raise ValueError(f"{what}: the factory returned None; it must return an environment (an object with reset(row) "
                         "and step(message))")
    check_environment(env, f"{what}: the {type(env).__name__} the factory returned")


def check_environment(env, what: str = "environment") -> None:
    """``env`` (an environment, or a class of them) has callable ``reset`` and ``step``."""
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise ValueError(f"{what} has no {method}() method (an environment needs reset(row) and step(message))")


def normalize_step(value) -> dict:
    """``step``'s return value as ``{"observation", "role", "done", "reward"}`` (JSON), or
    ValueError saying what is wrong with it."""
    if value is None:
        return {"observation": None, "role": "user", "done": True, "reward": None}
    if isinstance(value, str):
        return {"observation": value, "role": "user", "done": False, "reward": None}
    if isinstance(value, tuple) and len(value) in (2, 3):
        value = dict(zip(("observation", "done", "reward"), value))
    if not isinstance(value, dict):
        raise ValueError(f"step() returned {type(value).__name__}; expected a string, None, (observation, done[, "
                         "reward]) or a dict with observation / done / reward")
    obs, reward, role = value.get("observation"), value.get("reward"), value.get("role", "user")
    done = value.get("done", obs is None)
    if obs is not None and not isinstance(obs, str):
        raise ValueError(f"step()'s observation must be a string or None, got {type(obs).__name__}")
    if not isinstance(done, bool):
        raise ValueError(f"step()'s done must be true or false, got {done!r}")
    if not done and obs is None:
        raise ValueError("step() returned done=False without an observation (the model would get nothing to answer)")
    if role not in ("user", "tool"):
        raise ValueError(f"step()'s role must be 'user' or 'tool', got {role!r}")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"step()'s reward must be a finite number or None, got {reward!r}")
        reward = float(reward)
    return {"observation": obs, "role": role, "done": done, "reward": reward}


def check_reward(value) -> float | None:
    """``get_reward()``'s value: a finite number, or ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"get_reward() must return a finite number, got {value!r}")
    return float(value)


__all__ = ["ROW_FIELD", "check_environment", "check_factory", "check_made", "check_reward", "check_rows",
           "environment_of", "load_factories", "normalize_step", "probe_factory", "setting_of"]
