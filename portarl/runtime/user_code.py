"""The one guarded way into user code: reward functions, the trainer's hooks, and (issue
37) multi-turn tools and environments.

Why: a user's function is the one part of a run portarl does not control, and what it does
wrong must stop the run the documented way (a checkpoint of the last finished step, one
line naming the function, the sample and its prompt, exit 3), never end it silently. A
reward that called ``sys.exit(0)`` used to end a run with exit 0, no message and no
checkpoint (``SystemExit`` is not an ``Exception``); one that hung held the run forever,
and a SIGTERM then waited for a step that never finished.

API (everything a caller needs)::

    from portarl.runtime.user_code import UserCodeError, UserCodeGuard

    guard = UserCodeGuard(timeout_s=300.0, setting="train.reward_timeout_s")
    value = guard.call(fn, args, kwargs, what="reward 'accuracy'", where="sample 3 (prompt '1+1=')")
    with guard.watching():      # optional: many calls share one watchdog thread
        values = [guard.call(fn, (x,), what=..., where=...) for x in xs]

- :meth:`UserCodeGuard.call` returns what ``fn`` returns, or raises :class:`UserCodeError`
  (``what``, ``where``, ``kind``, ``signum``; its message is one line, e.g. ``reward
  'accuracy' called sys.exit(0) on sample 3 (prompt '1+1=')``) when ``fn``:

  - raises anything, ``BaseException`` included (``SystemExit``, ``KeyboardInterrupt``,
    ``GeneratorExit``): ``kind`` ``"raised"`` (``"exited"`` for ``SystemExit``); the run's
    own stop signals (:class:`~portarl.runtime.startup_signals.RunInterrupt`: a second Ctrl-C's
    abort) pass through unchanged, and so does a ``KeyboardInterrupt`` while SIGINT still
    has Python's default handler (a plain Ctrl-C where no run installed its handlers);
  - has not returned after ``timeout_s`` seconds: ``kind`` ``"timeout"``; the call is
    ended by an exception raised inside it (on the main thread: the watchdog sends the
    thread a signal whose handler raises, so a blocking ``sleep``, ``recv`` or ``wait`` ends
    too; on another thread: an asynchronous exception, delivered when the thread next runs
    Python code). A call that swallows that exception (``except BaseException``) and
    returns late is still a timeout; native code that holds the GIL and never returns
    cannot be ended from inside the process (SIGKILL, then ``--resume``, loses nothing
    checkpointed);
  - is running on the main thread when the run's first SIGINT / SIGTERM arrives (the
    trainer's handler calls :func:`interrupt_active_call`): ``kind`` ``"interrupted"``,
    ``signum`` set; the trainer saves a checkpoint of the last finished step and exits
    ``128 + signal`` as for any stop signal, without waiting for the call.

- ``UserCodeGuard(timeout_s, setting, error)``: ``timeout_s=None`` means no limit;
  ``setting`` is the config field named in the timeout message; ``error`` the
  :class:`UserCodeError` subclass raised (rewards: ``RewardError``). Its watchdog is one
  thread, started at the first call with a limit and stopped and joined by
  :meth:`~UserCodeGuard.close` (``with UserCodeGuard(...) as guard:`` closes it too; so
  does garbage collection); a call costs it no lock and no wake-up. A guard serves one
  thread at a time: give each thread that calls user code its own.
- A :class:`UserCodeError` that leaves ``GRPOTrainer.train_step`` stops the run the
  documented way (:func:`portarl.trainer.loop.stop_on_user_code`: a checkpoint of the last
  finished step, or none when an optimizer step of the iteration was already applied;
  exit 3, or ``128 + signal`` when a stop signal ended the call); a caller needs no
  handler of its own. Under several ranks, call :func:`agree_on_failure` where every rank
  passes (one rank's failure becomes every rank's: the stop's checkpoint is collective).
- Every call is recorded (:mod:`portarl.runtime.blackbox`): a process that dies inside user code
  (``os._exit``, a segfault, the OOM killer) is named by whoever reads the record after it,
  the supervising parent of the command line or the async worker's client.
- :func:`arity_problem` says, before the first call, how many arguments a function takes
  and how many portarl passes.

Rewards go through :class:`portarl.assets.reward_runner.RewardRunner` (its ``guard``), the
trainer's hooks through :func:`portarl.trainer.guards.hooks.apply_hooks`. The signal that wakes a
timed-out main thread is SIGURG, whose default action is to ignore it, so a wake-up that
arrives after the call ended is harmless.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import signal
import threading
import time
import weakref

from portarl.runtime import blackbox
from portarl.runtime.startup_signals import RunInterrupt

#: Wakes a timed-out call on the main thread (default action: ignore).
WAKE_SIGNAL = getattr(signal, "SIGURG", None)
#: A call that swallowed the exception ending it is woken again this often, until it returns.
REPOKE_S = 1.0


class UserCodeError(RuntimeError):
    """A call into user code failed; the message (one line) names the function, and where
    it was called (sample and prompt) when the caller said."""

    def __init__(self, what: str, where: str | None, problem: str, *, kind: str = "raised",
                 signum: int | None = None):
        super().__init__(f"{what} {problem}" + (f" on {where}" if where else ""))
        self.what, self.where, self.problem, self.kind, self.signum = what, where, problem, kind, signum

    @classmethod
    def elsewhere(cls, message: str, rank: int | None = None):
        """A copy of a failure raised elsewhere (another rank, the rollout worker), with its
        message as it was raised there."""
        err = cls.__new__(cls)
        RuntimeError.__init__(err, message if rank is None else f"{message} (on rank {rank})")
        err.what, err.where, err.problem, err.kind, err.signum = None, None, message, "raised", None
        return err


def agree_on_failure(ctx, failure: UserCodeError | None, kind: type = UserCodeError) -> UserCodeError | None:
    """Under several ranks, user code that fails on one rank must stop every rank: the stop
    saves a checkpoint, which is collective, so a rank that went on alone would hang its
    peers until the timeout. One flag reduction per call site; on a failure the first
    failing rank's message reaches every rank (as ``kind``; rank 0 writes the log)."""
    from portarl.runtime import distributed as pdist

    if not ctx.enabled or not pdist.any_rank(ctx, failure is not None):
        return failure
    import torch.distributed as dist

    messages: list = [None] * ctx.world_size
    dist.all_gather_object(messages, None if failure is None else str(failure), group=ctx.host_group)
    rank = next(r for r, m in enumerate(messages) if m is not None)
    return failure if failure is not None else kind.elsewhere(messages[rank], rank)


def arity_problem(fn, args: tuple, names: str) -> str | None:
    """Why ``fn`` cannot be called with ``args`` positionally, counted the way a user reads
    it ("takes 2 arguments (prompt, completion), portarl passes 3: (prompt, completion,
    answer)"), or None when it can (or has no signature to check). ``names``: what portarl
    passes, as the docs write it."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args)
        return None
    except TypeError:
        pass
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    kw_required = [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if len(required) == len(positional):
        takes = f"{len(positional)} argument{'s' if len(positional) != 1 else ''}"
    else:
        takes = f"{len(required)} to {len(positional)} arguments"
    takes += f" ({', '.join(p.name for p in positional)})" if positional else ""
    if kw_required:
        takes += f" and the keyword-only {', '.join(kw_required)} (which portarl does not pass)"
    return f"takes {takes}, portarl passes {len(args)}: ({names})"


class _Unwind(BaseException):
    """Raised inside user code to end a call (its time limit, or a stop signal). Not an
    ``Exception``, so the user's ``except Exception`` does not swallow it."""


class _Call:
    __slots__ = ("deadline", "ident", "main", "timed_out", "signum", "done", "outer", "outer_watched", "recorded")

    def __init__(self, timeout_s: float | None):
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s  # the watchdog moves it on
        self.ident = threading.get_ident()
        self.main = self.ident == threading.main_thread().ident
        self.timed_out, self.signum, self.done = False, None, False
        self.outer: _Call | None = None  # the main thread's guarded call this one runs inside
        self.outer_watched: _Call | None = None  # the guard's call this one runs inside
        self.recorded = 0  # its token in the flight recorder (portarl.runtime.blackbox)


#: The guarded call running on the main thread, where signal handlers run (None: none).
_main_call: _Call | None = None


def _on_wake(signum, frame) -> None:
    call = _main_call
    if call is not None and call.timed_out and not call.done:
        raise _Unwind()


def interrupt_active_call(signum: int) -> None:
    """For the run's stop-signal handler (main thread): end the guarded call in progress
    there, if any, now (it fails with ``kind`` ``"interrupted"``). Returns when none is."""
    call = _main_call
    if call is not None and not call.done:
        call.signum = signum
        raise _Unwind()


def call_in_progress() -> bool:
    """Whether a guarded call is running on the main thread (what a stop signal would end)."""
    call = _main_call
    return call is not None and not call.done


def _poke(call: _Call) -> None:
    """Raise :class:`_Unwind` inside the timed-out ``call``'s thread."""
    if call.main:
        if WAKE_SIGNAL is not None:
            signal.pthread_kill(call.ident, WAKE_SIGNAL)
    else:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(call.ident), ctypes.py_object(_Unwind))


class _Watchdog:
    """The thread that ends a guard's call whose time is up. The caller sets ``current``
    without a word to the thread (a call costs no lock and no wake-up): with nothing to
    watch the thread sleeps ``timeout_s``, and a call that starts meanwhile ends no earlier
    than that. :meth:`close` stops and joins it."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.current: _Call | None = None
        self.lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="portarl-user-code-watchdog", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """An outer call is current again: its deadline may come before the one slept for."""
        with self.lock:
            self.lock.notify()

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self.lock.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        with self.lock:
            while not self._closed:
                call = self.current
                if call is None or call.done:
                    self.lock.wait(self.timeout_s)
                    continue
                wait = call.deadline - time.monotonic()
                if wait > 0:
                    self.lock.wait(wait)
                    continue
                # Under the lock, and only while the call runs: its thread clears a late
                # asynchronous exception under the same lock (UserCodeGuard._leave).
                call.timed_out = True
                if not call.done:
                    _poke(call)
                call.deadline = time.monotonic() + REPOKE_S


def _python_ctrl_c(err: BaseException) -> bool:
    """A KeyboardInterrupt from Python's own SIGINT handler (no run installed one): the
    user pressed Ctrl-C, which passes through as Python would let it."""
    return (isinstance(err, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)


def describe(err: BaseException) -> tuple[str, str]:
    """``(kind, problem)`` for an exception that escaped user code."""
    if isinstance(err, SystemExit):
        return "exited", f"called sys.exit({'' if err.code is None else repr(err.code)})"
    text = " ".join(str(err).split())  # one line, whatever the message's layout
    return "raised", f"raised {type(err).__name__}" + (f": {text}" if text else "")


class UserCodeGuard:
    """Calls into user code with a time limit and every failure named (module docstring).
    A guard serves one thread at a time: give each thread that calls user code its own.
    Its watchdog thread starts at the first call with a time limit; :meth:`close` (or the
    guard's ``with`` block, or its garbage collection) stops and joins it."""

    def __init__(self, timeout_s: float | None = None, setting: str = "the time limit",
                 error: type[UserCodeError] = UserCodeError):
        """``setting``: the config field holding ``timeout_s`` (named in the timeout
        message); ``error``: the :class:`UserCodeError` subclass raised (rewards:
        :class:`~portarl.assets.reward_runner.RewardError`)."""
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"{setting} must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s, self.setting, self.error = timeout_s, setting, error
        self._watchdog: _Watchdog | None = None
        self._stop_watchdog = None
        self._depth = 0

    def __enter__(self) -> "UserCodeGuard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop and join the watchdog thread; a later call starts a new one."""
        if self._stop_watchdog is not None:
            self._stop_watchdog()  # weakref.finalize: runs once, then detached
            self._watchdog = self._stop_watchdog = None

    def _started_watchdog(self) -> _Watchdog:
        if self._watchdog is None:
            self._watchdog = _Watchdog(self.timeout_s)
            self._stop_watchdog = weakref.finalize(self, self._watchdog.close)
        return self._watchdog

    @contextlib.contextmanager
    def watching(self):
        """A block of calls (one per sample, say): the handler that lets the watchdog end a
        main-thread call is installed once for the block, and the previous one put back
        after. Re-entrant; :meth:`call` opens one for itself."""
        if self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        install = (self.timeout_s is not None and WAKE_SIGNAL is not None
                   and threading.current_thread() is threading.main_thread())
        previous = signal.signal(WAKE_SIGNAL, _on_wake) if install else None
        self._depth = 1
        try:
            yield self
        finally:
            self._depth = 0
            if install:
                signal.signal(WAKE_SIGNAL, previous)

    def call(self, fn, args: tuple = (), kwargs: dict | None = None, *, what: str, where: str | None = None):
        """``fn(*args, **kwargs)``, or :class:`UserCodeError` naming ``what`` and ``where``
        (the arguments as a tuple and a dict, so that any keyword, ``what`` included, reaches ``fn``)."""
        if not self._depth:  # a lone call: its own block
            with self.watching():
                return self.call(fn, args, kwargs, what=what, where=where)
        kwargs = kwargs or {}
        call = _Call(self.timeout_s)
        watchdog = self._started_watchdog() if self.timeout_s is not None else None
        call.recorded = blackbox.enter_call(what, where)  # named by the supervisor if the process dies in it
        try:
            try:
                self._enter(call, watchdog)
                value = fn(*args, **kwargs)
            finally:
                self._leave(call, watchdog)
        except _Unwind:
            self._leave(call, watchdog)
            raise self._ended(call, what, where) from None
        except RunInterrupt:
            self._leave(call, watchdog)
            raise
        except BaseException as err:  # noqa: BLE001  (that is the point: SystemExit too)
            self._leave(call, watchdog)
            if _python_ctrl_c(err):
                raise
            if call.timed_out or call.signum is not None:  # it swallowed the unwind, then failed
                raise self._ended(call, what, where) from err
            kind, problem = describe(err)
            raise self.error(what, where, problem, kind=kind) from err
        if call.timed_out or call.signum is not None:  # it swallowed the unwind and returned late
            raise self._ended(call, what, where)
        return value

    @staticmethod
    def _enter(call: _Call, watchdog: _Watchdog | None) -> None:
        global _main_call
        if call.main:
            call.outer, _main_call = _main_call, call
        if watchdog is not None:
            call.outer_watched, watchdog.current = watchdog.current, call

    @staticmethod
    def _leave(call: _Call, watchdog: _Watchdog | None) -> None:
        """Idempotent: a signal can interrupt it, and the handler calls it again."""
        global _main_call
        blackbox.leave_call(call.recorded)
        if call.done:
            return
        call.done = True  # before timed_out is read: see _Watchdog._run
        if call.main and _main_call is call:
            _main_call = call.outer
        if watchdog is None:
            return
        if watchdog.current is call:
            watchdog.current = call.outer_watched
            if call.outer_watched is not None:
                watchdog.notify()
        if call.timed_out and not call.main:
            with watchdog.lock:  # an asynchronous exception set after the call returned: dropped
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(call.ident), None)

    def _ended(self, call: _Call, what: str, where: str | None) -> UserCodeError:
        if call.signum is not None:
            name = signal.Signals(call.signum).name
            return self.error(what, where, f"was interrupted by {name}", kind="interrupted", signum=call.signum)
        return self.error(what, where, f"did not return within {self.setting}={self.timeout_s:g} s (hung, or "
                             f"slower than that: raise {self.setting} if it needs longer)", kind="timeout")


__all__ = ["UserCodeError", "UserCodeGuard", "agree_on_failure", "arity_problem", "call_in_progress",
           "interrupt_active_call"]
