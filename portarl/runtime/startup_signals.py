"""Stop signals that arrive while a command starts (imports, model build, resume).

The CLI installs :func:`startup_handler` for SIGINT and SIGTERM before anything heavy is
imported (this module imports nothing of portarl's, so it is light). The handler records
the signal and raises ``KeyboardInterrupt``, which the CLI turns into a clean exit
(130 / 143, no traceback). The record matters because Python raises a handler's exception
at whatever bytecode runs next: when that is a finaliser (``__del__``, a weakref callback)
the interrupt is printed and dropped, and start-up would carry on into training as if no
signal had come. :func:`portarl.trainer.run.signals.graceful_stop` asks
:func:`interrupted_during_startup` before the first step and refuses to start.
"""

from __future__ import annotations

import signal

_received: list[int] = []  # start-up signals, in order
_deferring: list[bool] = []  # inside deferred(): record only


class RunInterrupt(KeyboardInterrupt):
    """An interrupt of the run's own making (a stop signal's): never a failure of user code
    (:mod:`portarl.runtime.user_code` lets it pass). ``signum``: the signal."""

    signum: int | None = None


def startup_handler(signum, frame):
    """SIGINT / SIGTERM before training starts: record it, then interrupt (inside
    :func:`deferred`: record only; the block raises when it ends)."""
    _received.append(signum)
    if _deferring:
        return
    raise _interrupt(signum)


class deferred:
    """A block during which a start-up signal is recorded, not raised, and raised when the
    block ends: importing torch (its native modules initialise in Python frames), where an
    interrupt raised mid-import has aborted the process (SIGABRT, exit 134) instead of
    exiting 130 / 143. Keep such blocks short (imports, not model loads)."""

    def __enter__(self):
        _deferring.append(True)
        return self

    def __exit__(self, kind, err, tb):
        _deferring.pop()
        if kind is None and _received and not _deferring:
            raise _interrupt(_received[0])
        return False


def clear_startup_signals() -> None:
    _received.clear()


def interrupted_during_startup() -> KeyboardInterrupt | None:
    """The interrupt the first start-up signal raised (or should have), or None."""
    return _interrupt(_received[0]) if _received else None


def _interrupt(signum: int) -> KeyboardInterrupt:
    err = RunInterrupt(signal.Signals(signum).name)
    err.signum = signum
    return err
