"""The processes that calls into tools and environments start and leave running, ended at
the run's end, whichever ``rollout.tool_isolation``.

Why: a tool that starts a server or a background job (``subprocess.Popen`` it never
waits for, a shell's ``&``, ``setsid``, a daemon's double fork) left it running after the
run. With ``tool_isolation: none`` the tools run in the trainer's own process (or the async
worker's), which cannot be killed to end them; so while tools run here, this process is a
subreaper (:func:`portarl.runtime.process_tree.set_subreaper`): what a tool starts stays among its
descendants however it detaches, instead of going to ``init``. :meth:`Leftovers.watch`
notes the children that appear during each call, and their descendants as seen after it;
:meth:`Leftovers.close` (the agent's close: the run's end, every exit path) stops and
kills those trees (:func:`portarl.runtime.process_tree.end_tree`) and restores the subreaper
setting. The process's own children (a vLLM engine, compile workers) appear outside the
calls and are left alone. The cost: two reads of ``/proc/<pid>/task/*/children`` a call,
0.3 ms with 8 threads (measured on a loaded 2-core CPU; it grows with the thread count).

With ``tool_isolation: process`` the tool process is the subreaper and is ended with its
whole tree (:func:`portarl.runtime.lifeline.stop_child`); what this catches there is what a tool
process that *crashed* left: its orphans come to this process during the call that found
it dead, and are ended at once.

Not ended: a process that a tool's own process (or one it started) forked after the call
returned and that was handed to this process only after its parent exited (noted neither
during a call nor as a descendant afterwards); anything when this process is killed from
outside (``kill -9``, the OOM killer: nothing here runs), or not on Linux.

Reaped only at the end: a detached process that exits during the run stays a zombie of
this process (a process-table entry, no memory) until :meth:`Leftovers.close` reaps it.
Reaping it earlier could take the exit status from a tool's own ``Popen`` that waits for
it later, and nothing tells the two apart; a tool that detaches a short-lived process at
every call leaves that many entries until the run ends.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

from portarl.runtime.process_tree import children, descendants, end_tree, set_subreaper, stat

_lock = threading.Lock()
_holders = 0  # Leftovers in this process that made it a subreaper and have not closed yet
_was_subreaper: bool | None = None  # the setting before the first of them


def _arm() -> None:
    global _holders, _was_subreaper
    with _lock:
        if _holders == 0:
            _was_subreaper = set_subreaper(True)
        _holders += 1


def _disarm() -> None:
    """The last one to close restores the setting (trainers may close in any order)."""
    global _holders
    with _lock:
        _holders -= 1
        if _holders == 0 and _was_subreaper is not None:
            set_subreaper(_was_subreaper)


class Leftovers:
    """What tool calls in this process started (see the module docstring). One never
    closed (a trainer dropped without ``close``) still ends them when it is collected, or
    at the interpreter's exit at the latest."""

    def __init__(self):
        self.tracked: dict[int, int] = {}  # pid -> start time (a number may be reused)
        self._armed = [False]  # shared with the finalizer, which must not hold self
        self._finalizer = weakref.finalize(self, _close, self.tracked, self._armed, os.getpid())

    @contextlib.contextmanager
    def watch(self):
        """Around one call: the children this process gained during it are the call's."""
        if not self._armed[0]:
            _arm()
            self._armed[0] = True
        me = os.getpid()
        before = children(me)
        try:
            yield
        finally:
            _note(self.tracked, children(me) - before)

    def end(self) -> None:
        """End every tracked process and what it started since."""
        _end(self.tracked)

    def close(self) -> None:
        """End what the calls left (:meth:`end`) and restore the subreaper setting."""
        _close(self.tracked, self._armed, os.getpid())


def _note(tracked: dict[int, int], new: set[int]) -> None:
    """Track ``new`` and every descendant of what is tracked, as it is now (before an
    intermediate process exits and hands its children to this process, unnoted)."""
    for pid in new:
        if (got := stat(pid)) is not None:
            tracked[pid] = got.start
    for pid, start in list(tracked.items()):
        got = stat(pid)
        if got is None or got.start != start:
            del tracked[pid]  # ended (and reaped): its number may be another's now
            continue
        for child in descendants(pid) - tracked.keys():
            if (got := stat(child)) is not None:
                tracked[child] = got.start


def _end(tracked: dict[int, int]) -> None:
    _note(tracked, set())
    if tracked:
        end_tree(list(tracked))
    tracked.clear()


def _close(tracked: dict[int, int], armed: list, owner: int) -> None:
    if armed[0] and os.getpid() == owner:  # not in a forked copy of this process: they are not its
        _end(tracked)
        armed[0] = False
        _disarm()


__all__ = ["Leftovers"]
