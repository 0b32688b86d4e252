"""Stop signals: SIGINT (Ctrl-C) and SIGTERM (what Slurm, Kubernetes and most schedulers
send before killing a job) stop a run the same careful way.

- First signal: finish the current step (never half a step), save a checkpoint, exit with
  ``128 + signal number`` (130 for SIGINT, 143 for SIGTERM, the shell convention). When
  user code (a reward, :mod:`portarl.runtime.user_code`) is running, that call ends at once instead
  (it may be the reason the step never finishes): the step is abandoned with nothing of it
  applied, and the checkpoint is of the step before. Under
  torchrun the stop is collective: the trainer all-reduces the request once per step, so
  every rank saves together (DCP saving is a collective).
- Second signal: abort at once, raising :class:`AbortNow`; the message says truthfully
  whether the last finished step has a checkpoint (:func:`abort_message`).
- A signal during start-up (imports, model build, resume) ends the command without a
  traceback: the CLI turns SIGINT and SIGTERM into an interrupt (:func:`startup_handler`)
  and catches it; nothing is saved. The signal is also recorded, and
  :func:`graceful_stop` refuses to start training while one is pending: Python raises a
  handler's exception at whatever bytecode runs next, and when that is a finaliser
  (``__del__``, a weakref callback) the interrupt is printed and dropped, so start-up used
  to carry on into training as if no signal had come.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

from portarl.runtime.startup_signals import RunInterrupt, interrupted_during_startup
from portarl.runtime.user_code import call_in_progress, interrupt_active_call

log = logging.getLogger("portarl.train")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int | None) -> int:
    """The exit status for a run stopped by ``signum`` (130 when unknown: Ctrl-C)."""
    return 128 + int(signum if signum is not None else signal.SIGINT)


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum is not None else "an interrupt"


class StopRequested(RunInterrupt):
    """The run stopped on request after step ``step`` and saved ``checkpoint``."""

    def __init__(self, signum: int | None, step: int, checkpoint):
        super().__init__(f"stopped by {signal_name(signum)} after step {step}; checkpoint saved: {checkpoint}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class AbortNow(RunInterrupt):
    """A second stop signal: the run aborted where it was, without saving."""

    def __init__(self, signum: int):
        super().__init__(f"aborted by a second {signal_name(signum)}")
        self.signum = signum


def abort_message(err: AbortNow, trainer) -> str:
    """What a second signal left behind, checked on disk (not assumed)."""
    from portarl.trainer.checkpoint import step_of

    latest = trainer.checkpoints.latest()
    saved = step_of(latest) if latest is not None else None
    if saved == trainer.step:
        return f"{err}; step {trainer.step} had already been checkpointed ({latest}); continue with --resume"
    newest = f"the newest checkpoint is {latest}, --resume continues from step {saved}" if latest is not None \
        else "there is no checkpoint yet"
    return f"{err}: no checkpoint saved for step {trainer.step}; {newest}"


@contextlib.contextmanager
def graceful_stop(trainer):
    """While training: the first SIGINT/SIGTERM asks ``trainer`` to stop after the current
    step (``trainer.stop_requested``, ``trainer.stop_signal``); a second raises
    :class:`AbortNow`. Previous handlers are restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    missed = interrupted_during_startup()
    if missed is not None:  # a start-up signal whose interrupt was swallowed: do not start training
        raise missed

    def handler(signum, frame):
        if trainer.stop_requested:
            raise AbortNow(signum)
        # The request is recorded before anything is said: a second signal can arrive while
        # this handler still runs (a user who saw the message, a scheduler's follow-up), and
        # Python then runs this handler again, nested; it must find the first one recorded.
        trainer.stop_requested = True
        trainer.stop_signal = signum
        if call_in_progress():  # a reward (user code) is running: it may never return, so it ends now
            log.warning("%s: ending the user code in progress (step %d is abandoned, nothing of it applied), then "
                        "saving a checkpoint of step %d (send it again to abort now, without saving)",
                        signal_name(signum), trainer.step + 1, trainer.step)
            interrupt_active_call(signum)
        log.warning("%s: finishing step %d, then saving a checkpoint (send it again to abort now, without saving)",
                    signal_name(signum), trainer.step + 1)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
