"""Reward functions: ``fn(prompt, completion, answer) -> float``, by name or ``module:function``.

Built in:
- ``math_exact``: 1.0 when the completion's final answer equals the reference answer
  (the content of the last ``\\boxed{...}`` if there is one, else the last number), else 0.
- ``format``: 1.0 when the completion is a bare number or ends in ``\\boxed{number}``.
"""

from __future__ import annotations

import importlib
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


BUILTIN_REWARDS: dict[str, RewardFn] = {"math_exact": math_exact, "format": format_reward}


def resolve_reward(spec: str | RewardFn) -> RewardFn:
    """A built-in name, ``"package.module:function"``, or a callable."""
    if callable(spec):
        return spec
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: use a built-in ({', '.join(BUILTIN_REWARDS)}) or 'module:function'")
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward {spec!r} cannot be loaded: {err}") from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable")
    return fn
