"""One run per output directory at a time: an exclusive OS lock for the life of a run.

Why: two ``--resume`` runs on one directory both ran, and one's start-up deleted the other's
in-flight checkpoint as "incomplete"; a second run with ``--overwrite`` deleted a live run's
files, and both exited 0. The check for another run's files (:mod:`.run_dir`) only sees a
run once it has logged a step.

How: ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<output_dir>/.portarl.lock``, taken before
anything in the directory is read or deleted (``portarl train`` takes it right after
creating the directory, before ``--overwrite``, ``--resume`` or a fresh start touch a
file; :meth:`GRPOTrainer.train` takes it too, a no-op in a process that holds it, so a
library user is covered) and held until the run ends. The kernel releases it when the
process dies, however it dies (SIGKILL, the OOM killer), so a crash never leaves a stale
lock to clean up: the lock is the flock, never the file's existence (the file stays, and
holds the holder's pid and host for the refusal's message only). Under torchrun rank 0
holds it for the job (its ranks are one run; the others never take it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

from portarl.runtime.supervisor import command_pid
from portarl.trainer.run.output_dir import RunDirError

LOCK_NAME = ".portarl.lock"

#: Locks this process holds: resolved directory -> [descriptor, holders].
_held: dict[str, list[int]] = {}


def _key(output_dir) -> str:
    return str(Path(output_dir).resolve())


def _holder(path: Path) -> str:
    try:
        pid, _, host = path.read_text().strip().partition(" ")
    except OSError:
        pid, host = "", ""
    if not pid:
        return "a run that has just started"
    return f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")


def acquire(output_dir) -> None:
    """Take the lock of ``output_dir`` (which exists), or raise :class:`RunDirError` naming
    the run that holds it. Re-entrant within a process: each call needs a :func:`release`."""
    key = _key(output_dir)
    if key in _held:
        _held[key][1] += 1
        return
    path = Path(output_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise RunDirError(f"cannot create the run lock {path}: {err.strerror or err}; choose another --output-dir "
                          "(or fix its permissions)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirError(f"output directory {output_dir} is in use by another run ({_holder(path)}): wait for it to "
                          "end (or stop it), or choose another --output-dir") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{command_pid()} {socket.gethostname()}\n".encode())  # the command's pid (portarl/runtime/supervisor.py)
    except OSError:  # the message's detail only: the lock is held
        pass
    _held[key] = [fd, 1]


def release(output_dir) -> None:
    """Undo one :func:`acquire`; the last one closes the descriptor, which frees the lock."""
    key = _key(output_dir)
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[key]
        os.close(entry[0])


def is_lock_holder() -> bool:
    """Rank 0 of a torchrun job, or a process that is not part of one (before or after the
    process group exists: read from torchrun's environment)."""
    return os.environ.get("RANK", "0") == "0"


@contextlib.contextmanager
def held(output_dir, holder: bool = True):
    """The lock of ``output_dir`` for the block (``holder`` False: nothing, for ranks > 0)."""
    if not holder:
        yield
        return
    acquire(output_dir)
    try:
        yield
    finally:
        release(output_dir)


__all__ = ["LOCK_NAME", "acquire", "held", "is_lock_holder", "release"]
