"""Process-tree helpers for tests that check no process outlives its parent (the async
rollout worker and the vLLM engine it may start)."""

from __future__ import annotations

from pathlib import Path


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
