"""The guarded runner for user code (issue 33 items 1, 2 and 13): every BaseException a
user's function lets out is a named failure (SystemExit and KeyboardInterrupt included),
a call that outlives its limit is ended from inside, a stop signal ends the call in
progress, the run's own interrupts pass through, and the watchdog thread never outlives
its block."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from portarl.runtime.startup_signals import RunInterrupt
from portarl.runtime.user_code import UserCodeError, UserCodeGuard, arity_problem, interrupt_active_call

#: How long a "hung" call waits before it gives up by itself: a broken guard fails the test
#: by returning then; a working one ends the call long before, on any machine load.
HANG_S = 600.0


def _all_watchdogs() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "portarl-user-code-watchdog"}


@pytest.fixture(autouse=True)
def _watchdogs():
    """The watchdog threads started since the test began (a guard that an earlier test's
    traceback still holds keeps its own until collected)."""
    before = _all_watchdogs()
    return lambda: sorted(_all_watchdogs() - before, key=id)


class CustomBase(BaseException):
    pass


@pytest.fixture
def run_sigint_handler():
    """A run's own SIGINT handler (training installs one), so a KeyboardInterrupt out of
    user code is the code's own doing, not a Ctrl-C."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_under_pythons_default_handler_passes_through():
    # Python's own handler, set here: a test process started in the background of a
    # non-interactive shell (nohup, `cmd &`) inherits SIGINT ignored instead.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            UserCodeGuard(60.0).call(lambda: (_ for _ in ()).throw(KeyboardInterrupt), what="reward 'r'")
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("body, kind, problem", [
    (lambda: sys.exit(0), "exited", "called sys.exit(0)"),
    (lambda: sys.exit(1), "exited", "called sys.exit(1)"),
    (lambda: sys.exit(), "exited", "called sys.exit()"),
    (lambda: (_ for _ in ()).throw(KeyboardInterrupt), "raised", "raised KeyboardInterrupt"),
    (lambda: (_ for _ in ()).throw(CustomBase("odd")), "raised", "raised CustomBase: odd"),
    (lambda: {}["k"], "raised", "raised KeyError: 'k'"),
])
def test_every_base_exception_is_a_named_failure(body, kind, problem, run_sigint_handler, _watchdogs):
    guard = UserCodeGuard(timeout_s=60.0, setting="train.reward_timeout_s")
    with pytest.raises(UserCodeError) as caught:
        guard.call(body, what="reward 'r'", where="sample 3 (prompt '1+1=')")
    assert str(caught.value) == f"reward 'r' {problem} on sample 3 (prompt '1+1=')"
    assert caught.value.kind == kind and caught.value.what == "reward 'r'"
    guard.close()
    assert not _watchdogs()


def test_the_runs_own_interrupt_passes_through():
    err = RunInterrupt("SIGINT")
    with pytest.raises(RunInterrupt) as caught:
        UserCodeGuard(60.0).call(lambda: (_ for _ in ()).throw(err), what="reward 'r'")
    assert caught.value is err


def test_arguments_reach_the_function_whatever_their_names():
    def fn(a, b, what=None, where=None):
        return (a, b, what, where)

    got = UserCodeGuard(60.0).call(fn, (1, 2), {"what": "w", "where": "x"}, what="reward 'r'")
    assert got == (1, 2, "w", "x")


@pytest.mark.parametrize("blocking", [True, False], ids=["sleep", "python-loop"])
def test_a_hung_call_on_the_main_thread_is_ended_and_named(blocking, _watchdogs):
    assert threading.current_thread() is threading.main_thread()

    def hang():
        end = time.monotonic() + HANG_S
        if blocking:
            time.sleep(HANG_S)  # a blocking system call: only a signal ends it
        while time.monotonic() < end:
            pass
        return 1.0

    guard = UserCodeGuard(timeout_s=0.2, setting="train.reward_timeout_s")
    before = signal.getsignal(signal.SIGURG)
    with pytest.raises(UserCodeError) as caught:
        guard.call(hang, what="reward 'slow'", where="sample 0 (prompt 'p')")
    assert caught.value.kind == "timeout"
    assert "did not return within train.reward_timeout_s=0.2 s" in str(caught.value)
    assert signal.getsignal(signal.SIGURG) is before
    guard.close()
    assert not _watchdogs()


def test_a_call_that_swallows_the_unwind_is_still_a_timeout():
    def stubborn():
        end = time.monotonic() + HANG_S
        while time.monotonic() < end:
            try:
                time.sleep(HANG_S)
            except BaseException:  # a reward with a bare except: it gives up after the first wake-up
                return 0.0
        return 1.0

    with pytest.raises(UserCodeError, match="did not return within"):
        UserCodeGuard(timeout_s=0.2).call(stubborn, what="reward 'r'")


def test_a_hung_call_on_another_thread_is_ended_too():
    result = {}

    def hang():
        end = time.monotonic() + HANG_S
        while time.monotonic() < end:
            time.sleep(0.01)
        return 1.0

    def worker():
        try:
            result["value"] = UserCodeGuard(timeout_s=0.2).call(hang, what="tool 'search'")
        except UserCodeError as err:
            result["error"] = err

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert result["error"].kind == "timeout" and "tool 'search' did not return" in str(result["error"])


def test_one_watchdog_serves_every_call_and_close_joins_it(_watchdogs):
    with UserCodeGuard(timeout_s=30.0) as guard:
        with guard.watching():
            assert [guard.call(lambda x: x * 2, (i,), what="reward 'r'") for i in range(3)] == [0, 2, 4]
        with pytest.raises(UserCodeError):
            guard.call(lambda: sys.exit(2), what="reward 'r'")
        assert len(_watchdogs()) == 1
        guard.close()
        assert not _watchdogs()
        assert guard.call(lambda: 5, what="reward 'r'") == 5  # a new one after close
        assert len(_watchdogs()) == 1
    assert not _watchdogs()
    guard = UserCodeGuard(timeout_s=30.0)
    guard.call(lambda: 1, what="reward 'r'")
    del guard  # garbage collected: its watchdog is stopped and joined too
    assert not _watchdogs()


def test_a_stop_signal_ends_the_call_in_progress():
    """What the trainer's SIGINT / SIGTERM handler does (trainer/run/signals.py)."""
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: interrupt_active_call(signal.SIGTERM))

    def hang():
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(HANG_S)
        return 1.0

    try:
        with pytest.raises(UserCodeError) as caught:
            UserCodeGuard(timeout_s=None).call(hang, what="reward 'r'", where="sample 1 (prompt 'p')")
        assert caught.value.kind == "interrupted" and caught.value.signum == signal.SIGTERM
        assert str(caught.value) == "reward 'r' was interrupted by SIGTERM on sample 1 (prompt 'p')"
        os.kill(os.getpid(), signal.SIGUSR1)  # no call in progress: the handler does nothing
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_arity_problem_counts_what_the_function_takes_and_what_portarl_passes():
    names = "prompt, completion, answer"
    args = ("p", "c", "a")
    assert arity_problem(lambda prompt, completion, answer: 0, args, names) is None
    assert arity_problem(lambda *a: 0, args, names) is None
    assert arity_problem(lambda prompt, completion: 0, args, names) == \
        "takes 2 arguments (prompt, completion), portarl passes 3: (prompt, completion, answer)"
    assert arity_problem(lambda a, b, c, d, e=1: 0, args, names) == \
        "takes 4 to 5 arguments (a, b, c, d, e), portarl passes 3: (prompt, completion, answer)"
    assert "keyword-only k" in arity_problem(lambda a, b, c, *, k: 0, args, names)
