"""Reward functions, by name or ``module:function``; two forms (see the README's reward contract):

- per sample: ``fn(prompt, completion, answer) -> float``;
- batched, as TRL's: ``fn(prompts, completions, **columns) -> list[float | None]``, with every
  other column of the data rows; ``None`` means "no reward from this function for this sample".

Running them (shape checks, errors naming the function and the sample) is
:mod:`portarl.assets.reward_runner`.

Built in:
- ``math_exact``: 1.0 when the completion's final answer equals the reference answer
  (the content of the last ``\\boxed{...}`` if there is one, else the last number), else 0.
- ``format``: 1.0 when the completion is a bare number or ends in ``\\boxed{number}``.
- ``environment``: the reward the episode's environment gave (multi-turn rollouts with an
  ``environment``: the environment owns the reward; docs/agents.md).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
import re
from typing import Callable

RewardFn = Callable[[str, str, str], float]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_answer(text: str) -> str | None:
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a.strip() == b.strip()


def math_exact(prompt: str, completion: str, answer: str) -> float:
    got = extract_answer(completion)
    return 1.0 if got is not None and _same_number(got, answer) else 0.0


def format_reward(prompt: str, completion: str, answer: str) -> float:
    text = completion.strip()
    return 1.0 if _NUMBER.fullmatch(text) or re.search(r"\\boxed\{-?\d+(?:\.\d+)?\}$", text) else 0.0


def environment_reward(prompts, completions, env_reward=None, **columns) -> list:
    """Batched: each episode's environment reward (the ``env_reward`` column that
    multi-turn rollouts with an environment add: :mod:`portarl.multiturn.environment`)."""
    if env_reward is None:
        raise ValueError("the built-in reward 'environment' reads the env_reward column of multi-turn episodes with "
                         "an environment (config: environment: module:factory)")
    return list(env_reward)


BUILTIN_REWARDS: dict[str, RewardFn] = {"math_exact": math_exact, "format": format_reward,
                                        "environment": environment_reward}


def resolve_reward(spec: str | RewardFn, search_dirs: list[str | Path] | tuple = ()) -> RewardFn:
    """A built-in name, ``"package.module:function"``, or a callable.

    ``module`` is imported as Python would, and failing that from ``search_dirs`` (the
    current directory and the config file's directory): the installed ``portarl`` command
    does not have the current directory on ``sys.path`` as ``python -m`` does, so a
    ``myrewards.py`` next to the config would otherwise not be found.
    """
    if callable(spec):
        return spec
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: use a built-in ({', '.join(BUILTIN_REWARDS)}) or 'module:function'")
    module_name, _, attr = spec.partition(":")
    dirs = [str(Path(d).resolve()) for d in search_dirs]
    try:
        module = _import(module_name, dirs)
        fn = getattr(module, attr)
    except (ImportError, AttributeError) as err:
        where = f" (looked on sys.path and in {', '.join(dirs)})" if dirs else ""
        raise ValueError(f"reward {spec!r} cannot be loaded: {err}{where}") from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable")
    return fn


def _import(module_name: str, dirs: list[str]):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        top = module_name.split(".")[0]
        if err.name != top or not dirs:  # an import inside the user's module failed: report that
            raise
    added = [d for d in dirs if d not in sys.path]
    sys.path[:0] = added
    try:
        return importlib.import_module(module_name)
    finally:
        for d in added:
            if d in sys.path:
                sys.path.remove(d)
