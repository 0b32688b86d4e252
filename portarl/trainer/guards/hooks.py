"""Test hooks: ``trainer.hooks[point]`` lists ``fn(step, tensor) -> tensor`` applied at that
point of an iteration (to inject a NaN, say), and ``PORTARL_FAULT_INJECT`` installs such a
hook from the environment (how subprocess tests reach the guards).

Points: ``reward``, ``old_logp``, ``ref_logp``, ``advantage``, ``loss``, ``grad``.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("portarl.train")

HOOK_POINTS = ("reward", "old_logp", "ref_logp", "advantage", "loss", "grad")
FAULT_ENV = "PORTARL_FAULT_INJECT"


def empty_hooks() -> dict[str, list]:
    return {p: [] for p in HOOK_POINTS}


def apply_hooks(hooks: dict[str, list], point: str, step: int, tensor: torch.Tensor, guard=None) -> torch.Tensor:
    """Each hook of ``point`` in turn; through ``guard`` (a :class:`~portarl.runtime.user_code.UserCodeGuard`)
    when given: a hook that raises, exits or hangs is a named failure."""
    for fn in hooks[point]:
        if guard is None:
            tensor = fn(step, tensor)
        else:
            name = getattr(fn, "__name__", type(fn).__name__)
            tensor = guard.call(fn, (step, tensor), what=f"hook {name!r} at {point!r}", where=f"step {step}")
    return tensor


def install_fault_injection(hooks: dict[str, list], spec: str | None, rank: int) -> None:
    """TEST ONLY: ``PORTARL_FAULT_INJECT="point@step[@rank]"`` puts a NaN into that tensor
    at that step, on one rank or all."""
    if not spec:
        return
    for item in spec.split(","):
        parts = item.strip().split("@")
        point, at_step = parts[0], int(parts[1])
        only_rank = int(parts[2]) if len(parts) > 2 else None
        if point not in HOOK_POINTS:
            raise ValueError(f"{FAULT_ENV}: {point!r} is not one of {', '.join(HOOK_POINTS)}")
        if only_rank is not None and only_rank != rank:
            continue

        def poison(step, tensor, at_step=at_step):
            if step != at_step:
                return tensor
            tensor = tensor.clone()
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            local.view(-1)[0] = float("nan")
            return tensor

        hooks[point].append(poison)
        log.warning("fault injection (test only): NaN into %s at step %d%s", point, at_step,
                    "" if only_rank is None else f" on rank {only_rank}")
