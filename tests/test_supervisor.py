"""The supervising parent of ``portarl train / sft / eval`` (portarl/runtime/supervisor.py), its
flight recorder (portarl/runtime/blackbox.py) and the command it prints (portarl/runtime/continuation.py),
on a stand-in command that imports no torch (tests/supervised_stand_in.py): exit 0 only
for a child that finished and said so; any other end is one line naming the step, the
phase, the user function and what to run next; stop signals reach the child exactly once,
whether they were sent to the parent alone or to the whole process group."""

from __future__ import annotations

import os
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portarl.runtime import blackbox
from portarl.cli import build_parser
from portarl.runtime.continuation import continue_command, newest_checkpoint
from portarl.runtime.supervisor import EXIT_DIED, FORWARD_GRACE_S
from portarl.trainer.run.output_dir import check_output_dir
from proc_tree import line_queue

HERE = Path(__file__).parent
STAND_IN = HERE / "supervised_stand_in.py"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="os.fork, PR_SET_PDEATHSIG")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}


def _stand_in(scenario: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(STAND_IN), scenario, str(out)], env=_env(), capture_output=True,
                          text=True, timeout=120)


def test_exit_0_only_for_a_child_that_finished_and_said_so(tmp_path):
    done = _stand_in("finished", tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "parent imported torch: False" in done.stdout  # the parent adds no start-up time
    died = _stand_in("exit0", tmp_path)
    assert died.returncode == EXIT_DIED
    assert died.stderr.strip() == (
        "portarl train: the run died in step 3 (scoring), while reward 'r' on sample 0 (prompt '1+1=') was running: "
        "the process exited with code 0 without finishing (os._exit or exit() in user or native code); there is no "
        f"checkpoint yet; start again with: portarl train --output-dir {tmp_path}")


def test_a_sigkill_names_the_oom_killer_and_the_newest_checkpoint(tmp_path):
    for step in ("step-000001", "step-000002"):
        (tmp_path / "checkpoints" / step).mkdir(parents=True)
        (tmp_path / "checkpoints" / step / "COMPLETE").touch()
    (tmp_path / "checkpoints" / "step-000003").mkdir()  # not complete: not a checkpoint
    killed = _stand_in("sigkill", tmp_path)
    assert killed.returncode == 128 + signal.SIGKILL
    assert killed.stderr.strip() == (
        "portarl train: the run died in step 3 (scoring): the process was killed by SIGKILL (the out-of-memory "
        f"killer, or kill -9); the newest checkpoint is {tmp_path / 'checkpoints' / 'step-000002'}; continue with: "
        f"portarl train --output-dir {tmp_path} --resume")


def test_a_crash_after_the_child_finished_keeps_its_exit_and_says_so(tmp_path):
    run = _stand_in("finished-then-abort", tmp_path)
    assert run.returncode == 0
    assert run.stderr.strip() == ("portarl train: the process was killed by SIGABRT after the run had finished (exit 0); "
                                  "nothing was lost")
    failed = _stand_in("failed-then-abort", tmp_path)  # found by the chaos run: a SIGTERM during an exit 4
    assert failed.returncode == 4
    assert failed.stderr.strip() == ("portarl train: the process was killed by SIGABRT on its way out, after it ended "
                                     "with exit 4 (the line above says why)")


def test_stop_signals_reach_the_child_once_sent_to_the_parent_or_to_the_group(tmp_path):
    proc = subprocess.Popen([sys.executable, str(STAND_IN), "signals", str(tmp_path)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    got, reader = line_queue(proc.stdout)
    seen = []
    try:
        assert got.get(timeout=120).strip() == "ready"
        for _ in range(2):  # the parent alone (kill PID, a container's stop): forwarded, each one
            proc.send_signal(signal.SIGTERM)
            seen.append(got.get(timeout=120).strip())
        os.killpg(proc.pid, signal.SIGINT)  # the whole group (Ctrl-C, torchrun's teardown): not forwarded again
        seen.append(got.get(timeout=120).strip())
        # A duplicate would be forwarded FORWARD_GRACE_S after the parent's own copy (the
        # wait only lets a wrong forward show; load can only hide one, never make one).
        time.sleep(2 * FORWARD_GRACE_S + 1)
        (tmp_path / "done").touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join()
    while not got.empty():
        seen.append(got.get().strip())
    assert proc.returncode == 0, err
    assert [s for s in seen if s.startswith("got")] == ["got SIGTERM", "got SIGTERM", "got SIGINT"], seen


def test_the_flight_recorder_keeps_the_innermost_call_and_costs_nothing_unattached(tmp_path):
    assert blackbox.enter_call("reward 'r'") == 0  # not attached: nothing recorded
    blackbox.attach(blackbox.create(tmp_path / "record"))
    try:
        blackbox.note(step=2, phase="rollout", rank=1)
        outer = blackbox.enter_call("environment 'E' step()")
        inner = blackbox.enter_call("tool 'search'", "episode 3")
        assert blackbox.read(tmp_path / "record")["call"] == "tool 'search' on episode 3"
        blackbox.leave_call(inner)
        blackbox.leave_call(inner)  # idempotent
        record = blackbox.read(tmp_path / "record")
        assert record["call"] == "environment 'E' step()" and record["step"] == "2" and record["rank"] == "1"
        blackbox.leave_call(outer)
        blackbox.enter_call("reward 'r'", "x" * 10_000)  # cut at the field's size, never past it
        assert blackbox.read(tmp_path / "record")["call"].startswith("reward 'r' on xxx")
        assert blackbox.doing(blackbox.read(tmp_path / "record")).startswith(" in step 2 (rollout), while reward")
    finally:
        blackbox.detach()


def test_a_lost_rank_says_resume_only_when_there_is_a_checkpoint(tmp_path):
    from portarl.runtime.heartbeat import _what_next

    assert "continue with --resume" in _what_next()  # nothing recorded (a library user): as before
    blackbox.attach(blackbox.create(tmp_path / "record"))
    try:
        blackbox.note(output_dir=tmp_path)
        assert _what_next().startswith("there is no checkpoint yet: start the run again without --resume")
        (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
        (tmp_path / "checkpoints" / "step-000001" / "COMPLETE").touch()
        assert "continue with --resume" in _what_next()
    finally:
        blackbox.detach()


@pytest.mark.parametrize("typed", [["--resume"], ["--overwrite"], [], ["--resume-or-start"]])
def test_the_printed_command_is_one_the_cli_accepts(tmp_path, typed):
    """Without a checkpoint: no --resume (refused: nothing to continue), and --overwrite
    exactly when the directory holds steps a fresh start would refuse."""
    argv = ["train", "--output-dir", str(tmp_path), *typed]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    for checkpoint in (None, tmp_path / "checkpoints" / "step-000001"):
        args = build_parser().parse_args(continue_command(argv, tmp_path, checkpoint).split()[1:])
        assert args.resume == (checkpoint is not None) and args.overwrite == (checkpoint is None)
        check_output_dir(tmp_path, resume=args.resume, overwrite=args.overwrite)  # not refused
    (tmp_path / "metrics.jsonl").unlink()
    args = build_parser().parse_args(continue_command(argv, tmp_path, None).split()[1:])
    assert not args.resume and not args.overwrite
    check_output_dir(tmp_path)
    assert newest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("form", ["--output-dir", "--output-dir=", "--set"])
def test_a_death_during_start_up_names_the_newest_checkpoint_of_the_command_lines_directory(tmp_path, form):
    """Found by the chaos run (portarl bench chaos): a SIGKILL while the child was still
    importing (before it noted its output directory) said "there is no checkpoint yet" of a
    run with one; the parent now reads the directory from the command line."""
    from types import SimpleNamespace

    from portarl.runtime.supervisor import Supervisor

    (tmp_path / "metrics.jsonl").write_text('{"step": 2}\n')
    (tmp_path / "checkpoints" / "step-000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000002" / "COMPLETE").touch()
    named = {"--output-dir": ["--output-dir", str(tmp_path)], "--output-dir=": [f"--output-dir={tmp_path}"],
             "--set": ["--set", f"output_dir={tmp_path}"]}[form]
    sup = Supervisor(SimpleNamespace(command="train", argv=["train", *named, "--set", "train.steps=4"]))
    try:
        line = sup._next({"output_dir": ""})
    finally:
        shutil.rmtree(sup.dir, ignore_errors=True)
    assert line.startswith(f"the newest checkpoint is {tmp_path / 'checkpoints' / 'step-000002'}"), line
    assert "--resume" in line
