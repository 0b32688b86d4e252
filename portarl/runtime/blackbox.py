"""The flight recorder of a run's process: what it is doing now (step, phase, the user
function running, the newest checkpoint, the exit it declared), kept in a small shared file
that a process outside it reads after it died.

Why: a reward that calls ``os._exit(0)``, a tool that segfaults, the OOM killer's SIGKILL:
none of them lets the process say anything. The supervising parent of ``portarl train``,
``sft`` and ``eval`` (:mod:`portarl.runtime.supervisor`) and the trainer's client of the async
rollout worker (:mod:`portarl.trainer.asynchronous.client`) read this file once the process
is gone, to name the step, the phase and the function that was running.

Cost: the file is ``mmap``-ed; a field is written as its bytes then their length (a field
torn by a death mid-write reads as its older value or a prefix of the new one). A guarded
call into user code writes one field on entry and one on exit, about a microsecond each
(rewards are called per sample); in a process that attached no file (a library user,
an in-process test) every function here returns after one check.

Standard library only: the supervisor reads it without importing torch.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

#: The variable that names the file for a process started with ``subprocess`` (the rollout
#: worker); a forked child attaches directly (:func:`attach`).
ENV = "PORTARL_BLACKBOX"

#: Field name -> capacity in bytes (each field: a 2-byte length, then UTF-8 text).
FIELDS = {"exit": 16, "rank": 16, "output_dir": 1024, "step": 32, "phase": 64, "call": 2800}
SIZE = 4096
_OFFSETS: dict[str, tuple[int, int]] = {}
_offset = 0
for _name, _cap in FIELDS.items():
    _OFFSETS[_name] = (_offset, _cap)
    _offset += 2 + _cap
assert _offset <= SIZE

_mm: mmap.mmap | None = None
_calls: list[str] = []  # the user functions running, innermost last (a tool called inside an episode's call)


def create(path) -> Path:
    """A zeroed recorder file at ``path`` (every field empty)."""
    path = Path(path)
    with open(path, "wb") as f:
        f.write(b"\0" * SIZE)
    return path


def attach(path) -> None:
    """Record into ``path`` (made by :func:`create`) from now on in this process."""
    global _mm
    fd = os.open(path, os.O_RDWR)
    try:
        _mm = mmap.mmap(fd, SIZE)
    finally:
        os.close(fd)
    _calls.clear()


def detach() -> None:
    """Record nothing from now on (the file stays as it is)."""
    global _mm
    _mm = None
    _calls.clear()


def attach_from_env() -> None:
    """:func:`attach` the file named by :data:`ENV`, if any."""
    path = os.environ.get(ENV)
    if path:
        attach(path)


def attached() -> bool:
    return _mm is not None


def _put(name: str, text: str) -> None:
    offset, cap = _OFFSETS[name]
    data = text.encode("utf-8", "replace")[:cap]
    mm = _mm
    mm[offset:offset + 2] = b"\0\0"
    mm[offset + 2:offset + 2 + len(data)] = data
    mm[offset:offset + 2] = len(data).to_bytes(2, "little")


def note(**fields) -> None:
    """Record ``step``, ``phase``, ``rank``, ``output_dir`` (any of them)."""
    if _mm is None:
        return
    for name, value in fields.items():
        _put(name, "" if value is None else str(value))


def declare(code: int) -> None:
    """This process is about to exit with ``code`` on a path of its own (it said why)."""
    if _mm is not None:
        _put("exit", str(int(code)))


def enter_call(what: str, where: str | None = None) -> int:
    """A call into user code starts (``what``: "reward 'x'", ``where``: "sample 3 (...)");
    returns the token :func:`leave_call` takes."""
    if _mm is None:
        return 0
    text = what if where is None else f"{what} on {where}"
    _calls.append(text)
    _put("call", text)
    return len(_calls)


def leave_call(token: int) -> None:
    """The call :func:`enter_call` returned ``token`` for has ended (idempotent)."""
    if _mm is None or token == 0 or len(_calls) < token:
        return
    del _calls[token - 1:]
    _put("call", _calls[-1] if _calls else "")


def recorded(name: str) -> str:
    """This process's own value of field ``name`` ("" when nothing is attached)."""
    if _mm is None:
        return ""
    offset, cap = _OFFSETS[name]
    size = int.from_bytes(_mm[offset:offset + 2], "little")
    return _mm[offset + 2:offset + 2 + min(size, cap)].decode("utf-8", "replace")


def read(path) -> dict[str, str]:
    """Every field of the file at ``path`` (empty strings when it cannot be read)."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        raw = b""
    out = {}
    for name, (offset, cap) in _OFFSETS.items():
        size = int.from_bytes(raw[offset:offset + 2], "little") if len(raw) >= offset + 2 else 0
        out[name] = raw[offset + 2:offset + 2 + min(size, cap)].decode("utf-8", "replace")
    return out


def doing(record: dict[str, str]) -> str:
    """What a :func:`read` record says the process was doing, to follow a verb: " in step 3
    (scoring), while reward 'x' on sample 0 (prompt '1+1=') was running" (empty: nothing)."""
    at = f" in step {record['step']}" if record.get("step") else ""
    phase = f" ({record['phase']})" if record.get("phase") else ""
    call = f", while {record['call']} was running" if record.get("call") else ""
    return f"{at}{phase}{call}"


__all__ = ["ENV", "attach", "attach_from_env", "attached", "create", "declare", "detach", "doing", "enter_call",
           "leave_call", "note", "read", "recorded"]
