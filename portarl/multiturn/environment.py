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

The episode's environment reward, ``get_reward()`` when the environment defines it (and it
returns a number), else the sum of the rewards its ``step`` calls returned (0.0 when none
did, e.g. an episode cut at ``rollout.max_turns`` before a final step), is the column
``env_reward`` of each sample, which the built-in reward ``environment`` returns
(``rewards: [{name: environment}]``): the environment owns the reward. An environment that
raises, hangs or returns something else ends its episode with an error message in the
conversation and ``agent/env_errors``, and its env reward is 0.0.
"""

from __future__ import annotations

import math

from portarl.multiturn.tools import load_object

ROW_FIELD = "environment"


def load_factories(spec, search_dirs=()) -> dict[str | None, object]:
    """``{name: factory}`` (name None for a single environment) from the config's ``environment``."""
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
        setting = "environment" if name is None else f"environment.{name}"
        factory = load_object(target, search_dirs, setting)
        if not callable(factory):
            raise ValueError(f"{setting}: {target!r} is not callable (a class or a function returning an environment)")
        out[name] = factory
    return out


def environment_of(row: dict, names) -> str | None:
    """Which environment a data row names (None: the single one)."""
    if list(names) == [None]:
        return None
    name = row.get(ROW_FIELD)
    if name not in names:
        raise ValueError(f"the data row names environment {name!r} in its {ROW_FIELD!r} column; the config's "
                         f"environment mapping has {', '.join(map(repr, names))}")
    return name


def check_environment(env, setting: str = "environment") -> None:
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise ValueError(f"{setting}: the factory's object has no {method}() method (an environment needs "
                             "reset(row) and step(message))")


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


__all__ = ["ROW_FIELD", "check_environment", "check_reward", "environment_of", "load_factories", "normalize_step"]
