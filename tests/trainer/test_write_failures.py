"""A checkpoint or summary write that fails (file-size limit, no permission) ends the run
with one line naming the file, the system's reason, the last intact checkpoint and the
command that continues the run, exit 4; the partial ``.tmp-step-*`` is gone, the earlier
checkpoints verify, and that command continues the run (issue 33 item 4). The real CLI
in subprocesses: a full file system through ``RLIMIT_FSIZE`` (SIGXFSZ ignored, so a write
fails with EFBIG instead of killing the process) and read-only files and directories."""

from __future__ import annotations

import ctypes
import os
import resource
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from portarl.trainer.checkpoint import CheckpointManager
from portarl.trainer.checkpoint import manifest as mf
from trainer_fast import FAST

#: Between the largest log or state file of the tiny run's first steps (metrics.jsonl, a few
#: KiB; trainer_state.json, 16 KiB) and its model.safetensors (86 KiB).
FILE_SIZE_LIMIT = 60_000
_PR_CAPBSET_DROP, _DAC_CAPS = 24, (1, 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


def _args(out: Path, steps: int, *extra: str) -> list[str]:
    sets = [x for item in (*FAST, f"train.steps={steps}", "checkpoint.every=1") for x in ("--set", item)]
    return ["train", "--device", "cpu", "--output-dir", str(out), *sets, *extra]


def _env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    return env


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # ignored dispositions survive exec
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


def _without_root_override():
    """Root ignores permission bits; without these capabilities (dropped from the bounding
    set, so exec keeps them dropped) it obeys them like any user."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for cap in _DAC_CAPS:
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            os._exit(97)


def _portarl(args: list[str], preexec=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "portarl", *args], env=_env(), capture_output=True, text=True,
                          timeout=900, preexec_fn=preexec)
    if proc.returncode == 97:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here (running as root without CAP_SETPCAP)")
    return proc


def _as_user():
    return _without_root_override if os.geteuid() == 0 else None


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("portarl train: cannot write")]
    return line


def _continue_with(line: str, preexec=None) -> subprocess.CompletedProcess:
    command = shlex.split(line.split("continue with: ", 1)[1])
    assert command[:2] == ["portarl", "train"] and command[-1] == "--resume"
    return _portarl(command[1:], preexec)


def _no_partial(out: Path) -> None:
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_a_full_file_system_names_the_file_keeps_the_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "run"
    assert _portarl(_args(out, 2)).returncode == 0
    line = _one_line(_portarl(_args(out, 4, "--resume"), _limit_file_size))
    tmp = f"{out}/checkpoints/.tmp-step-000003-"
    assert line.startswith(f"portarl train: cannot write {tmp}") and "/model.safetensors: File too large (EFBIG); " \
        f"the last intact checkpoint is {out}/checkpoints/step-000002 (step 2); make room" in line, line
    _no_partial(out)
    mf.verify(out / "checkpoints" / "step-000002")
    done = _continue_with(line)
    assert done.returncode == 0, done.stderr[-3000:]
    assert CheckpointManager(out).latest().name == "step-000004"


def test_a_write_failure_before_the_first_checkpoint_gives_a_command_that_works(tmp_path):
    """No checkpoint yet (step 1's is the write that failed; step 1 is in metrics.jsonl):
    "continue with" used to say --resume, which is refused. Now: the command again, with
    --overwrite (the directory holds a logged step), and it trains to the end."""
    out = tmp_path / "run"
    line = _one_line(_portarl(_args(out, 2), _limit_file_size))
    assert "; there is no checkpoint yet; make room" in line, line
    command = shlex.split(line.split("continue with: ", 1)[1])
    assert command[:2] == ["portarl", "train"] and "--resume" not in command and command[-1] == "--overwrite", line
    done = _portarl(command[1:])
    assert done.returncode == 0, done.stderr[-3000:]
    assert CheckpointManager(out).latest().name == "step-000002"


def test_a_read_only_checkpoint_directory_names_it_and_exits_4(tmp_path):
    out = tmp_path / "run"
    assert _portarl(_args(out, 2)).returncode == 0
    (out / "checkpoints").chmod(0o555)
    try:
        line = _one_line(_portarl(_args(out, 4, "--resume"), _as_user()))
        assert line.startswith(f"portarl train: cannot write {out}/checkpoints/.tmp-step-000003-") and \
            ": Permission denied (EACCES); the last intact checkpoint is " \
            f"{out}/checkpoints/step-000002 (step 2)" in line, line
    finally:
        (out / "checkpoints").chmod(0o755)
    _no_partial(out)
    mf.verify(out / "checkpoints" / "step-000002")
    assert _continue_with(line).returncode == 0


def test_a_summary_that_cannot_be_written_is_one_line_after_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    assert _portarl(_args(out, 2)).returncode == 0
    (out / "summary.txt").chmod(0o444)
    line = _one_line(_portarl(_args(out, 3, "--resume"), _as_user()))
    assert line.startswith(f"portarl train: cannot write {out}/summary.txt: Permission denied (EACCES); the last "
                           f"intact checkpoint is {out}/checkpoints/step-000003 (step 3)"), line
    mf.verify(out / "checkpoints" / "step-000003")


def test_a_disk_full_error_that_a_library_reports_as_text_is_named():
    """safetensors (Rust) reports the system's error only in its message."""
    from portarl.trainer.run.write_failure import WriteFailed, writing

    with pytest.raises(WriteFailed, match=r"^cannot write /x/model.safetensors: No space left on device \(ENOSPC\)$"):
        with writing("/x/model.safetensors"):
            raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    with pytest.raises(ValueError):  # not a failed write: left alone
        with writing("/x/model.safetensors"):
            raise ValueError("a bug")


def test_a_full_file_system_under_weight_sync_file_is_one_line_and_the_run_continues(tmp_path):
    """``rollout.weight_sync: file``: the trainer publishes each weight version to a slot
    file the async worker loads; a write of it that fails (here the first slot of a resumed
    run, 86 KiB, over the limit) is the same one line and exit 4 as a checkpoint's, naming
    the slot file. Before, safetensors' error escaped as a 46-line traceback, exit 1."""
    out = tmp_path / "run"
    sets = ("--set", "rollout.mode=async", "--set", "rollout.weight_sync=file")
    assert _portarl(_args(out, 1, *sets)).returncode == 0
    line = _one_line(_portarl(_args(out, 2, *sets, "--resume"), _limit_file_size))
    assert line.startswith(f"portarl train: cannot write {out}/async_weights/weights-slot") and \
        f": File too large (EFBIG); the last intact checkpoint is {out}/checkpoints/step-000001 (step 1)" in line, line
    assert not (out / "async_weights").exists()
    done = _continue_with(line)
    assert done.returncode == 0, done.stderr[-3000:]
    assert CheckpointManager(out).latest().name == "step-000002"
