"""A child process that dies with its parent: the asynchronous rollout worker and the tool
process of multi-turn rollouts. Standard library only, so a child that needs nothing else
(the tool process) starts without importing torch."""

from __future__ import annotations

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
