"""Finding a job's processes and injecting one fault into them.

A ``portarl train`` command is a supervising parent and the child that trains
(:mod:`portarl.runtime.supervisor`); under torchrun, an agent and one such pair per rank; in
async mode the trainer's child starts the rollout worker (``python -m
portarl.rollout.async_worker``). Processes are told apart by their command line and, for a
rank, by ``RANK`` in their environment (Linux ``/proc``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from portarl.runtime import process_tree


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _rank(pid: int) -> int:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return -1
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:] or 0)
    return 0


def _is_train(cmd: list[str]) -> bool:
    """``python -m portarl train ...`` (not torchrun's agent, whose own arguments end the same)."""
    if "torch.distributed.run" in cmd or "-m" not in cmd:
        return False
    at = cmd.index("-m")
    return cmd[at + 1:at + 3] == ["portarl", "train"]


def trainer_pid(root: int, rank: int = 0) -> int | None:
    """The training child of ``rank`` (a ``portarl train`` whose parent is one too)."""
    for pid in sorted(process_tree.descendants(root) | {root}):
        st = process_tree.stat(pid)
        if st is None or not _is_train(_cmdline(pid)) or not _is_train(_cmdline(st.ppid)):
            continue
        if _rank(pid) == rank:
            return pid
    return None


def worker_pid(root: int) -> int | None:
    """The async rollout worker, once started."""
    for pid in sorted(process_tree.descendants(root)):
        if "portarl.rollout.async_worker" in _cmdline(pid):
            return pid
    return None


def inject(fault, root: int, chaos_dir: Path, judge) -> dict | None:
    """Inject ``fault`` into the job whose top process is ``root``; what was done, or None
    when its target does not exist yet (the worker before it starts: try again soon)."""
    kind = fault.kind
    if kind in ("sigkill_trainer", "sigkill_rank", "sigkill_worker"):
        pid = (worker_pid(root) if kind == "sigkill_worker"
               else trainer_pid(root, 1 if kind == "sigkill_rank" else 0))
        if pid is None:
            return None
        os.kill(pid, signal.SIGKILL)
        return {"signal": "SIGKILL", "pid": pid}
    if kind == "sigterm_job":
        os.kill(root, signal.SIGTERM)
        return {"signal": "SIGTERM", "pid": root}
    if kind in ("disk_full_checkpoint", "disk_full_weights"):
        name = "disk_full." + kind.rsplit("_", 1)[1]
        (chaos_dir / name).write_text("")
        return {"armed": name}
    if kind == "reward_raises":
        (chaos_dir / "reward_raises").write_text("")
        return {"armed": "reward_raises"}
    if kind == "judge_outage":
        judge.outage(fault.duration_s)
        return {"judge_down_s": fault.duration_s}
    raise ValueError(f"unknown fault kind {kind!r}")


#: The faults that wait in a file for the run to reach them: kind -> file.
ARMED = {"disk_full_checkpoint": "disk_full.checkpoint", "disk_full_weights": "disk_full.weights",
         "reward_raises": "reward_raises"}


def disarm(chaos_dir: Path) -> list[str]:
    """Remove armed faults that no write or reward consumed (their launch ended first)."""
    left = []
    for name in ARMED.values():
        try:
            (chaos_dir / name).unlink()
            left.append(name)
        except FileNotFoundError:
            pass
    return left


__all__ = ["ARMED", "disarm", "inject", "trainer_pid", "worker_pid"]
