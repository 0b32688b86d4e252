"""The supervising parent of ``portarl train``, ``sft`` and ``eval``: a run that ends is a
run that says why.

Why: user code can end the process without a word. A reward that called ``os._exit(0)``
ended a run with exit 0, no line and no checkpoint; a segfaulting reward ended it with 139
and nothing naming it; the OOM killer's SIGKILL says nothing either. No code inside the
process can answer for those, so the command forks right after parsing its arguments
(nothing heavy imported yet: no start-up time is added), the child does the work as before,
and this parent waits for it:

- the child records what it is doing in a small shared file (:mod:`portarl.runtime.blackbox`: the
  step, the phase, the user function running, the output directory) and, on every path of
  its own, the exit code it declares (it said its line already);
- an exit the child declared passes through unchanged, and silently;
- any other end is a death: one line naming the rank (under torchrun), the step, the phase,
  the user function that was running, how it died (the exit code, or the signal: a crash
  names the file holding its Python frames, written by :mod:`faulthandler`), the newest
  checkpoint on disk and the command that continues the run
  (:func:`portarl.runtime.continuation.continue_command`); exit :data:`EXIT_DIED` for an exit,
  ``128 + signal`` for a signal. So exit 0 means the child finished and said so: the last
  step finished and was saved.

Stop signals: the parent forwards SIGINT and SIGTERM to the child, unless the child got the
same signal itself (Ctrl-C in a terminal and torchrun's teardown signal the whole process
group, a scheduler may signal every process): the child's receipt is written at once, from
the C-level handler, to a pipe the parent reads (``signal.set_wakeup_fd``); a signal the
child has not received within :data:`FORWARD_GRACE_S` is forwarded. So a signal reaches the
child once either way, and the documented codes (130 / 143 after a checkpoint, a second
signal's abort) are the child's. The child dies with the parent (``PR_SET_PDEATHSIG``): a
SIGKILL of the command kills the run, whose lock (held by the child) the kernel releases.

Only the command line is supervised (``main()`` with ``argv`` None, the console script and
``python -m portarl``); ``PORTARL_SUPERVISE=0`` turns it off (a debugger, say). Standard
library only.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from portarl.runtime import blackbox
from portarl.runtime.continuation import continue_command, newest_checkpoint, rerun_command

#: The commands that run user code and so are supervised.
SUPERVISED = ("train", "sft", "eval")
#: Exit status when the run's process exited without finishing and without saying why
#: (``os._exit`` or ``exit()`` in user or native code).
EXIT_DIED = 5
OFF_ENV = "PORTARL_SUPERVISE"
#: How long the parent waits for the child to report a stop signal it got itself before
#: forwarding it. Delivery to every process of a group is immediate; the child's report
#: comes from its C-level handler as soon as the kernel schedules it (milliseconds on a
#: loaded machine), and a forward that waits this long delays a stop by a second at most.
FORWARD_GRACE_S = 1.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: In the run's directory: the Python frames of a crash (:mod:`faulthandler`), every rank's.
CRASH_LOG = "crash.log"

#: What each way of dying most likely was, for the line.
_SIGNAL_CAUSES = {
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a crash in native code",
    signal.SIGILL: "a crash in native code",
    signal.SIGFPE: "a crash in native code",
    signal.SIGABRT: "an abort in native code",
    signal.SIGKILL: "the out-of-memory killer, or kill -9",
}
#: The signals :mod:`faulthandler` writes Python frames for.
_FAULTS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)


def wanted(args, argv) -> bool:
    """Whether this ``main()`` call supervises its command (module docstring)."""
    return (argv is None and getattr(args, "command", None) in SUPERVISED and hasattr(os, "fork")
            and os.environ.get(OFF_ENV, "1") != "0")


class Supervisor:
    """The parent's side: the child's pid, the recorder file, the signal pipe."""

    def __init__(self, args):
        self.command = args.command
        self.argv = list(args.argv)
        self.dir = Path(tempfile.mkdtemp(prefix="portarl-run-"))
        self.record = blackbox.create(self.dir / "blackbox")
        self.crash_path = self.dir / "crash.log"
        self.child = 0
        self.pending: list[tuple[int, float]] = []  # stop signals the parent got: (signum, when)
        self.child_got: list[tuple[int, float]] = []  # those the child reported: (signum, when)
        self.echoes: list[int] = []  # signals forwarded whose receipt the child has not reported yet

    @classmethod
    def for_command(cls, args, argv) -> "Supervisor | None":
        """The supervisor of this ``main()`` call, or None: not :func:`wanted`, or no
        temporary directory for its record (the command then runs as one process)."""
        if not wanted(args, argv):
            return None
        try:
            return cls(args)
        except OSError as err:
            _log(f"portarl {args.command}: running unsupervised (no temporary directory for its record: {err})")
            return None

    # ------------------------------------------------------------------ start
    def fork(self) -> bool:
        """Fork; True in the child (which goes on with the command), False in the parent."""
        self.report_r, report_w = os.pipe()
        self.wake_r, wake_w = os.pipe()
        for fd in (self.report_r, report_w, self.wake_r, wake_w):
            os.set_blocking(fd, False)
        sys.stdout.flush()
        sys.stderr.flush()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # no handler runs half set up
        pid = os.fork()
        if pid == 0:
            os.close(self.report_r)
            os.close(self.wake_r)
            os.close(wake_w)
            self._become_child(report_w)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            return True
        self.child = pid
        os.close(report_w)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        for s in STOP_SIGNALS:
            signal.signal(s, self._on_signal)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return False

    def _become_child(self, report_w: int) -> None:
        from portarl.runtime.lifeline import die_with_parent

        global _command_pid
        _command_pid = os.getppid()
        die_with_parent(_command_pid)
        blackbox.attach(self.record)
        blackbox.note(rank=os.environ.get("RANK", "") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "",
                      phase="start-up")
        signal.set_wakeup_fd(report_w, warn_on_full_buffer=False)  # a signal's receipt, at once
        import faulthandler

        # A fatal signal's Python frames, moved into the run's directory by the parent.
        faulthandler.enable(file=open(self.crash_path, "a"), all_threads=True)  # noqa: SIM115 (for the process' life)

    def _on_signal(self, signum, frame) -> None:
        self.pending.append((signum, time.monotonic()))

    # ------------------------------------------------------------------ wait
    def wait(self) -> int:
        """Forward stop signals until the child ends; then the exit code (module docstring)."""
        try:
            status = self._wait_for_child()
            return self._outcome(status)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _wait_for_child(self) -> int:
        try:
            exited = os.pidfd_open(self.child)
        except (AttributeError, OSError):  # no pidfd (an old kernel): poll
            exited = None
        try:
            while True:
                timeout = self._forward_due()
                fds = [self.wake_r, self.report_r] + ([exited] if exited is not None else [])
                if exited is None:
                    timeout = 0.05 if timeout is None else min(timeout, 0.05)
                ready, _, _ = select.select(fds, [], [], timeout)
                for fd in (self.wake_r, self.report_r):
                    if fd in ready:
                        self._drain(fd)
                pid, status = os.waitpid(self.child, os.WNOHANG)
                if pid == self.child:
                    return status
        finally:
            if exited is not None:
                os.close(exited)

    def _drain(self, fd: int) -> None:
        try:
            data = os.read(fd, 512)
        except BlockingIOError:
            return
        if fd == self.report_r:
            now = time.monotonic()
            for signum in data:
                if signum not in STOP_SIGNALS:
                    continue
                if signum in self.echoes:  # the receipt of a signal this parent forwarded
                    self.echoes.remove(signum)
                else:
                    self.child_got.append((signum, now))

    def _forward_due(self) -> float | None:
        """Match the parent's stop signals with the child's own receipts; forward those the
        child has not had within :data:`FORWARD_GRACE_S`. Returns how long until the next
        one is due (None: none pending)."""
        now = time.monotonic()
        for signum, when in list(self.pending):
            got = next((c for c in self.child_got if c[0] == signum), None)
            if got is not None:
                self.child_got.remove(got)
                self.pending.remove((signum, when))
            elif now - when >= FORWARD_GRACE_S:
                self.pending.remove((signum, when))
                self.echoes.append(signum)
                try:
                    os.kill(self.child, signum)
                except ProcessLookupError:
                    pass
        self.child_got = [c for c in self.child_got if now - c[1] < FORWARD_GRACE_S]
        if not self.pending:
            return None if not self.child_got else FORWARD_GRACE_S
        return max(0.0, min(when + FORWARD_GRACE_S - now for _, when in self.pending))

    # --------------------------------------------------------------- outcome
    def _outcome(self, status: int) -> int:
        record = blackbox.read(self.record)
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        code = 128 + signum if signum is not None else os.WEXITSTATUS(status)
        declared = int(record["exit"]) if record["exit"].lstrip("-").isdigit() else None
        if declared is not None:
            if declared != code:  # it finished and said so, then died on its way out
                how = f"killed by {signal.Signals(signum).name}" if signum is not None else f"exited with code {code}"
                if declared == 0:
                    _log(f"portarl {self.command}: {self._who(record)}the process was {how} after the run had "
                         "finished (exit 0); nothing was lost")
                else:  # found by the chaos run: "after the run had finished" of a run that had failed
                    _log(f"portarl {self.command}: {self._who(record)}the process was {how} on its way out, "
                         f"after it ended with exit {declared} (the line above says why)")
            return declared
        crash = self._keep_crash_log(record, signum)
        how = self._how(signum, code, crash)
        if signum in STOP_SIGNALS:
            what = f"was stopped by {signal.Signals(signum).name}{blackbox.doing(record)} before it could save"
        else:
            what = f"died{blackbox.doing(record)}: {how}"
        _log(f"portarl {self.command}: {self._who(record)}the run {what}; {self._next(record)}")
        return code if signum is not None else EXIT_DIED

    @staticmethod
    def _who(record: dict) -> str:
        return f"rank {record['rank']}: " if record["rank"] else ""

    @staticmethod
    def _how(signum: int | None, code: int, crash: Path | None) -> str:
        if signum is None:
            return f"the process exited with code {code} without finishing (os._exit or exit() in user or native code)"
        cause = _SIGNAL_CAUSES.get(signum)
        frames = f"; its Python frames are in {crash}" if crash is not None else ""
        return f"the process was killed by {signal.Signals(signum).name}" + (f" ({cause}{frames})" if cause else frames)

    def _keep_crash_log(self, record: dict, signum: int | None) -> Path | None:
        """faulthandler's report of a fatal signal, moved into the run's directory (where
        there is one; else printed), or None."""
        if signum not in _FAULTS or not self.crash_path.is_file() or not self.crash_path.stat().st_size:
            return None
        if not record["output_dir"] or not Path(record["output_dir"]).is_dir():
            sys.stderr.write(self.crash_path.read_text(errors="replace"))
            return None
        kept = Path(record["output_dir"]) / CRASH_LOG
        try:
            with kept.open("a") as f:
                header = f"rank {record['rank']}:\n" if record["rank"] else ""
                f.write(header + self.crash_path.read_text(errors="replace"))
        except OSError:
            return None
        return kept

    def _next(self, record: dict) -> str:
        if self.command != "train":
            return f"nothing was saved; run it again with: {rerun_command(self.argv)}"
        # A death during start-up comes before the child noted its directory: the command line's.
        output_dir = record["output_dir"] or _output_dir_in(self.argv)
        checkpoint = newest_checkpoint(output_dir) if output_dir else None
        command = continue_command(self.argv, output_dir or None, checkpoint)
        if checkpoint is None:
            return f"there is no checkpoint yet; start again with: {command}"
        return f"the newest checkpoint is {checkpoint}; continue with: {command}"


def _output_dir_in(argv: list[str]) -> str | None:
    """The output directory a command line names (``--output-dir D``, ``--output-dir=D``,
    ``--set output_dir=D``; the last one wins, as in the parser), else None (a config file's
    ``output_dir`` is read only by the child)."""
    found = None
    for i, arg in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if arg == "--output-dir" and nxt is not None:
            found = nxt
        elif arg.startswith("--output-dir="):
            found = arg.split("=", 1)[1]
        elif arg == "--set" and nxt is not None and nxt.startswith("output_dir="):
            found = nxt.split("=", 1)[1]
    return found


#: The supervising parent's pid, in the child it forked (None elsewhere).
_command_pid: int | None = None


def command_pid() -> int:
    """The pid of the command a user started and sees: the supervising parent's in its child,
    else this process's (named by the run lock to a second run, :mod:`portarl.trainer.run.lock`)."""
    return _command_pid if _command_pid is not None else os.getpid()


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


__all__ = ["EXIT_DIED", "SUPERVISED", "Supervisor", "command_pid", "wanted"]
