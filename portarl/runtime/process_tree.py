"""Process trees: every process a child started, in whatever process group or session,
found and ended with it (Linux; elsewhere the child alone).

Why: killing a process does not kill what it started. A tool that starts a server or a
background job (``subprocess.Popen``, a shell's ``&``, ``setsid``, a daemon's double
fork) leaves processes that a kill of the tool's process, or of its process group, does
not reach: its children are handed to ``init`` and run on after the run.

Two kernel facilities make the whole tree reachable:

- a *subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``, :func:`set_subreaper`) becomes the
  parent of its descendants' orphans instead of ``init``, so everything it ever started,
  however detached, stays among its descendants until it ends;
- ``/proc/<pid>/task/<tid>/children`` lists a process's children without a scan of every
  process (:func:`children`).

:func:`end_tree` stops a tree before it kills it (``SIGSTOP``, repeated down the tree until
no new process appears: a stopped process can neither fork nor reap, so no pid found can
be reused meanwhile), then sends ``SIGKILL`` to every process found, and reaps those that
are (or, as their parents die, become) this process's children, so that no zombie is left
behind either.

What no one but the kernel could end: a process that leaves the tree through a service
(``systemd-run``, ``at``, a container runtime), or one whose subreaper ancestor was killed
from outside (``kill -9``, the OOM killer) before :func:`end_tree` ran: its orphans went to
the next subreaper up, or ``init``. Standard library only (the tool process imports it).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from typing import NamedTuple

log = logging.getLogger("portarl")

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37

#: How long :func:`end_tree` waits for the processes it stopped, then killed, to get there:
#: both take effect at once except for a process inside an uninterruptible system call (a
#: hung network file system), which this bounds.
SETTLE_S = 30.0


def set_subreaper(on: bool = True) -> bool | None:
    """Make this process a subreaper (or stop it being one); returns whether it was one
    before, None where the system has no subreapers (nothing changed)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    was = ctypes.c_int(0)
    if prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0) != 0:
        return None
    if prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        return None
    return bool(was.value)


class Stat(NamedTuple):
    state: str   # R, S, D, T, Z, ...
    ppid: int
    pgid: int
    start: int   # clock ticks after boot: with the pid, names one process (pids are reused)


def stat(pid: int) -> Stat | None:
    """``pid``'s state, parent, process group and start time; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))


def _scan(field: str, value: int) -> set[int]:
    """Every process whose ``field`` (``ppid``, ``pgid``) is ``value``, by a scan of /proc."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (got := stat(int(entry))) is not None and getattr(got, field) == value:
            found.add(int(entry))
    return found


def children(pid: int) -> set[int]:
    """The children of ``pid`` (an empty set when it is gone or the system has no /proc)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return set()
    found: set[int] = set()
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.update(int(p) for p in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # a thread that ended meanwhile
            return _scan("ppid", pid)  # CONFIG_PROC_CHILDREN off
        except OSError:
            continue
    return found


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (a snapshot: a running tree changes meanwhile)."""
    found, frontier = set(), [pid]
    while frontier:
        for child in children(frontier.pop()) - found:
            found.add(child)
            frontier.append(child)
    return found


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):  # gone, or a setuid program: not ours to end
        return False


def _settled(pid: int, start: int, states: str) -> bool:
    got = stat(pid)
    return got is None or got.start != start or got.state in states


def _wait_for(pids: dict[int, int], states: str, deadline: float) -> None:
    pending = dict(pids)
    while pending and time.monotonic() < deadline:
        pending = {p: s for p, s in pending.items() if not _settled(p, s, states)}
        if pending:
            time.sleep(0.002)


def end_tree(roots) -> dict[int, int]:
    """Stop ``roots`` (pids) and all their descendants, then kill them and reap those that
    are or become this process's children; returns ``{pid: start time}`` of those ended. A
    root must be a process whose number cannot be reused meanwhile (a child not yet
    reaped, or one checked against its start time just before)."""
    deadline = time.monotonic() + SETTLE_S
    found = _kill_tree(roots, deadline)
    reap(found, deadline)
    return found


def _kill_tree(roots, deadline: float) -> dict[int, int]:
    """:func:`end_tree` but the reaping."""
    found: dict[int, int] = {}
    frontier = list(roots)
    while frontier:
        for pid in frontier:
            got = stat(pid)
            if got is not None and pid not in found and got.state not in "ZX" and _signal(pid, signal.SIGSTOP):
                found[pid] = got.start
        _wait_for(found, "TtZX", deadline)  # stopped: it can no longer fork, nor reap a child found below
        frontier = [child for pid in found for child in children(pid) if child not in found]
    for pid in found:
        _signal(pid, signal.SIGKILL)
    return found


def reap(pids: dict[int, int], deadline: float) -> None:
    """Wait until each of ``pids`` (``{pid: start time}``, killed) has ended, reaping it
    where it is this process's child: a killed process's own children come here as it dies
    when this process is their subreaper."""
    me, pending = os.getpid(), dict(pids)
    while pending:
        for pid, start in list(pending.items()):
            got = stat(pid)
            if got is None or got.start != start:
                del pending[pid]
            elif got.ppid == me:
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        del pending[pid]
                except ChildProcessError:  # reaped by its owner (a Popen's wait) meanwhile
                    del pending[pid]
            elif got.state in "ZX" and got.ppid not in pending:
                del pending[pid]  # its parent (init, another subreaper) reaps it
        if pending:
            if time.monotonic() > deadline:
                log.warning("processes %s did not end within %.0f s of SIGKILL (an uninterruptible system call?)",
                            sorted(pending), SETTLE_S)
                return
            time.sleep(0.002)


def end_child(proc) -> None:
    """End ``proc`` (a ``subprocess.Popen``), everything it started and, when it leads its
    own process group (``start_new_session``), whatever is left in that group; reap it.
    Its number (and its group's) stays reserved until it is reaped, so nothing here can hit
    another process; once reaped (by an earlier ``wait``), nothing is left to do."""
    if proc.returncode is not None:
        return
    deadline = time.monotonic() + SETTLE_S
    got = stat(proc.pid)
    group = _scan("pgid", proc.pid) if got is not None and got.pgid == proc.pid else set()
    found = _kill_tree([proc.pid, *group], deadline)  # group: members its death left outside the tree
    proc.kill()  # already done where /proc lists it; elsewhere the child alone
    proc.wait()  # first: its zombie children come to this process (a subreaper) only once it is gone
    found.pop(proc.pid, None)
    reap(found, deadline)


__all__ = ["children", "descendants", "end_child", "end_tree", "reap", "set_subreaper", "stat"]
