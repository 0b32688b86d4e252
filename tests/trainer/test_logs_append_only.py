"""metrics.jsonl / events.jsonl are never rewritten in place: a failure at start-up (file-size
limit, SIGKILL) leaves the old file whole, and a torn last line is repaired (issue 12, item 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from portarl.trainer.run.logfiles import TMP_SUFFIX, prepare_log
from portarl.trainer.run.logger import RunLogger, read_metrics


def _write_rows(path: Path, steps, torn: str = "") -> bytes:
    data = "".join(json.dumps({"step": s, "reward/mean": s / 10, "pad": "x" * 100}) + "\n" for s in steps) + torn
    path.write_text(data)
    return data.encode()


def _start_logger_in_subprocess(out: Path, resume_step: int, prelude: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(f"""
        import os, resource, signal, sys
        from pathlib import Path
        from portarl.trainer.run.logger import RunLogger
        {prelude}
        RunLogger(Path({str(out)!r}), total_steps=200, resume_step={resume_step}, tensorboard=False, progress=False)
        print("started")
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_rows_past_the_resumed_step_and_a_torn_line_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, range(1, 11), torn='{"step": 11, "rew')
    assert prepare_log(path, resume_step=7) == 4  # steps 8, 9, 10 and the torn line
    assert [r["step"] for r in read_metrics(path)] == list(range(1, 8))
    assert path.read_text().endswith("\n")


def test_nothing_to_drop_leaves_the_file_untouched(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, range(1, 6))
    before = path.stat()
    assert prepare_log(path, resume_step=5) == 0
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)


def test_torn_last_line_is_repaired_not_propagated(tmp_path):
    _write_rows(tmp_path / "metrics.jsonl", range(1, 4), torn='{"step": 4, "reward/me')
    logger = RunLogger(tmp_path, total_steps=10, resume_step=3, tensorboard=False, progress=False)
    logger.step({"step": 4, "reward/mean": 0.5})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]  # every line parses


def test_file_size_limit_at_start_up_loses_no_row(tmp_path):
    """The old code truncated then rewrote: a write failing in between lost the rows for good."""
    original = _write_rows(tmp_path / "metrics.jsonl", range(1, 101))
    events = _write_rows(tmp_path / "events.jsonl", range(1, 101))
    limit = len(original) // 4  # smaller than the kept rows: writing them must fail
    done = _start_logger_in_subprocess(tmp_path, 83, f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))")
    assert done.returncode != 0 and "File too large" in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").read_bytes() == original
    assert (tmp_path / "events.jsonl").read_bytes() == events
    assert not list(tmp_path.glob(f"*{TMP_SUFFIX}"))
    done = _start_logger_in_subprocess(tmp_path, 83, "")  # space again: the resume goes on
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 84))


def test_kill_at_start_up_leaves_the_log_whole(tmp_path):
    original = _write_rows(tmp_path / "metrics.jsonl", range(1, 51))
    # SIGKILL after the kept rows are written to the new file, before it replaces the log.
    kill = "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)"
    done = _start_logger_in_subprocess(tmp_path, 20, kill)
    assert done.returncode == -9
    assert (tmp_path / "metrics.jsonl").read_bytes() == original
    assert (tmp_path / f"metrics.jsonl{TMP_SUFFIX}").exists()
    # SIGKILL in the middle of writing the new file.
    kill = ("import portarl.trainer.run.logfiles as lf\n"
            "class _F:\n"
            "    def __init__(self, f): self.f = f\n"
            "    def __enter__(self): return self\n"
            "    def __exit__(self, *a): pass\n"
            "    def writelines(self, lines):\n"
            "        self.f.write(b''.join(lines)[:100]); self.f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
            "_open = Path.open\n"
            "Path.open = lambda self, mode='r', *a, **k: _F(_open(self, mode)) if self.name.endswith(lf.TMP_SUFFIX) "
            "else _open(self, mode, *a, **k)")
    done = _start_logger_in_subprocess(tmp_path, 20, kill.replace("\n", "\n        "))
    assert done.returncode == -9, done.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").read_bytes() == original
    done = _start_logger_in_subprocess(tmp_path, 20, "")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 21))
    assert not (tmp_path / f"metrics.jsonl{TMP_SUFFIX}").exists()
