"""Choose the backend for one op call, and keep a record of every fallback.

Order: an explicit ``backend=`` argument, else ``PORTARL_BACKEND``, else the device's own
backend (cuda -> "cuda", npu -> "npu", anything else -> "reference"). An explicitly named
backend that cannot run raises :class:`BackendUnavailableError`. When the device's own
backend cannot run (triton missing on a GPU machine, say), the call goes to the reference
backend, a debug log line says why, and :func:`fallbacks` records it: never silent.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os

import torch

from portarl.backends.base import Backend, BackendUnavailableError
from portarl.backends.registry import BACKEND_NAMES, get_backend_by_name

log = logging.getLogger("portarl.dispatch")

#: Environment variable that forces one backend for every op call.
BACKEND_ENV = "PORTARL_BACKEND"

_NATIVE = {"cuda": "cuda", "npu": "npu"}


@dataclasses.dataclass(frozen=True)
class Fallback:
    op: str
    wanted: str
    used: str
    device: str
    reason: str


_fallbacks: collections.deque[Fallback] = collections.deque(maxlen=1000)
_fallback_counts: collections.Counter[tuple[str, str, str]] = collections.Counter()


def fallbacks() -> list[Fallback]:
    """The most recent fallbacks (at most 1000), oldest first."""
    return list(_fallbacks)


def fallback_counts() -> dict[tuple[str, str, str], int]:
    """Total fallbacks since start (or :func:`clear_fallbacks`), keyed by (op, wanted, used)."""
    return dict(_fallback_counts)


def clear_fallbacks() -> None:
    _fallbacks.clear()
    _fallback_counts.clear()


def _explicit(backend: str | Backend, op: str, device: torch.device, origin: str) -> Backend:
    chosen = backend if isinstance(backend, Backend) else get_backend_by_name(backend, origin=origin)
    reason = chosen.unavailable_reason(device)
    if reason is not None:
        raise BackendUnavailableError(
            f"{origin} asks for the {chosen.name!r} backend, which cannot run {op} on "
            f"{device}: {reason}"
        )
    return chosen


def choose_backend(op: str, device: torch.device, backend: str | Backend | None = None) -> Backend:
    """The backend that will compute ``op`` on tensors on ``device``."""
    if backend is not None:
        return _explicit(backend, op, device, "backend=")
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        return _explicit(forced.strip().lower(), op, device, f"{BACKEND_ENV}={forced!r}")
    wanted = get_backend_by_name(_NATIVE.get(device.type, "reference"))
    reason = wanted.unavailable_reason(device)
    if reason is None:
        return wanted
    used = get_backend_by_name("reference")
    record = Fallback(op=op, wanted=wanted.name, used=used.name, device=str(device), reason=reason)
    _fallbacks.append(record)
    _fallback_counts[(op, wanted.name, used.name)] += 1
    log.debug("%s on %s: %s backend unavailable (%s); using %s", op, device, wanted.name, reason, used.name)
    return used


__all__ = [
    "BACKEND_ENV",
    "BACKEND_NAMES",
    "Fallback",
    "choose_backend",
    "clear_fallbacks",
    "fallback_counts",
    "fallbacks",
]
