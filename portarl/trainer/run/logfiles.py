"""Start-up handling of the append-only run logs (``metrics.jsonl``, ``events.jsonl``).

Why: rewriting a log in place at every start (truncate, then write the kept rows) loses
rows for good when anything interrupts that window: a full disk, a file-size limit, a
SIGKILL. Here the file is never truncated: when rows past the resumed step or a torn last
line (a crash mid-write) must go, the kept rows are written to a temporary file in the same
directory, fsynced and renamed over the log (an atomic replace), then the directory is
fsynced. Any interruption leaves either the old file or the new one, both whole; a torn
line is dropped, never carried into the rows that follow. When nothing must go the file is
left untouched and opened for appending.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TMP_SUFFIX = ".rewrite-tmp"


def _parse(line: bytes):
    try:
        row = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return row if isinstance(row, dict) else None


def kept_lines(path: Path, resume_step: int) -> tuple[list[bytes], int]:
    """The complete lines of ``path`` with ``step <= resume_step``, and how many lines (later
    rows, a torn or unparseable line) would be dropped."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline; else a torn last line
    dropped = 1 if tail else 0
    kept = []
    for line in lines:
        row = _parse(line)
        if row is None or not isinstance(row.get("step", 0), int) or row.get("step", 0) > resume_step:
            dropped += 1
            continue
        kept.append(line + b"\n")
    return kept, dropped


def prepare_log(path: Path, resume_step: int) -> int:
    """Make ``path`` hold only whole rows up to ``resume_step`` without rewriting it in place;
    returns how many lines were dropped (0: the file was left untouched)."""
    path = Path(path)
    leftover = path.with_name(path.name + TMP_SUFFIX)
    if leftover.exists():  # an earlier start was interrupted before its rename: the log is intact
        leftover.unlink()
    if not path.exists():
        return 0
    kept, dropped = kept_lines(path, resume_step)
    if not dropped:
        return 0
    try:
        with leftover.open("wb") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(leftover, path)
    except BaseException:
        leftover.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return dropped
