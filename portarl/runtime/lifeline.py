"""Child processes that speak over pipes: the asynchronous rollout worker and the tool
process of multi-turn rollouts. The child dies with its parent (:func:`die_with_parent`)
and is the subreaper of what it starts (:func:`adopt_orphans`); the parent kills it with
everything it started and joins it and its reader thread (:func:`stop_child`). Standard
library only, so a child that needs nothing else (the tool process) starts without
importing torch."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the trainer dies (Linux), else poll the parent id."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0:  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)
            return
    except OSError:
        pass

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="portarl-worker-watchdog", daemon=True).start()


def adopt_orphans() -> None:
    """Make this child the subreaper of what it starts (tools, environments): a process one
    of them detaches (``setsid``, a double fork) stays in this child's tree, which
    :func:`stop_child` ends whole (:mod:`portarl.runtime.process_tree`)."""
    from portarl.runtime.process_tree import set_subreaper

    set_subreaper(True)


def stop_child(proc, reader: threading.Thread) -> None:
    """Kill ``proc`` if it still runs, with every process it started (its whole tree and its
    process group: :func:`portarl.runtime.process_tree.end_child`), wait for it, close its pipes
    and join the thread that reads its stdout (every exit path)."""
    from portarl.runtime.process_tree import end_child

    try:
        end_child(proc)  # its pending replies are not needed
    finally:
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.close()
        reader.join()
        proc.stdout.close()
