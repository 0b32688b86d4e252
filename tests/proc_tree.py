"""Process-tree helpers for tests that check no process outlives its parent (the async
rollout worker and the vLLM engine it may start), find the process doing a command's work,
or read a running command's output line by line."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import threading
from pathlib import Path


def line_queue(stream) -> tuple[queue.Queue, threading.Thread]:
    """``stream`` (a process's stdout or stderr) read line by line on a thread, into a
    queue (the thread is joined by the caller once the process ended)."""
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            lines.put(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    return lines, reader


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (read from /proc; a process gone meanwhile is skipped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it, parents first."""
    found = [pid]
    for child in children(pid):
        found += tree(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything it started, as a machine's power going off would
    (torchrun starts its ranks in sessions of their own, so a process group is not enough)."""
    for each in tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous or a stand-in server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def supervised(pid: int) -> int:
    """The process doing the work of the ``portarl`` command ``pid``: the child its
    supervising parent forked (portarl/runtime/supervisor.py: the same command line), or ``pid``
    itself when it has none (not yet forked, or not supervised)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid
    for child in children(pid):
        try:
            if Path(f"/proc/{child}/cmdline").read_bytes() == command:
                return child
        except OSError:
            continue
    return pid


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an exited child not yet reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def sleepers(path: Path) -> list[int]:
    """The pids a test tool wrote to ``path`` (tests/trainer/agent_tools.py:spawn), one a line."""
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def left_running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running ``sleep`` (a number reused by another program is not one)."""
    running = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if alive(pid) and cmdline[:1] == [b"sleep"]:
            running.append(pid)
    return running
