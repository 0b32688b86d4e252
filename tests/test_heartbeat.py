"""The heartbeat's logic in one process (the 2-process SIGSTOP test is in tests/distributed)."""

from __future__ import annotations

import time

import torch.distributed as dist

from portarl.heartbeat import Heartbeat


class _Recorder(Heartbeat):
    def _lost(self, what, rank):  # instead of ending the process
        self.lost = (what, rank, time.monotonic())
        self._stop.set()


def _pair(timeout_s=2.0):
    store = dist.HashStore()
    return [_Recorder(store, r, 2, timeout_s) for r in (0, 1)]


def test_a_silent_rank_is_named_within_the_limit():
    watcher, frozen = _pair()
    watcher.start(), frozen.start()
    time.sleep(0.5)
    frozen._stop.set()  # its thread stops beating, as a SIGSTOPped process would
    frozen_at = time.monotonic()
    deadline = frozen_at + watcher.timeout_s + 2
    while not hasattr(watcher, "lost") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hasattr(watcher, "lost"), "the silent rank was never reported"
    what, rank, at = watcher.lost
    assert rank == 1 and what.startswith("rank 1 has sent no heartbeat")
    assert at - frozen_at <= watcher.stale_after + 2 * watcher.interval + 0.5


def test_a_rank_that_finished_is_not_reported():
    watcher, done = _pair()
    watcher.start(), done.start()
    time.sleep(0.3)
    done.stop()  # normal exit: marks itself done
    time.sleep(watcher.stale_after + 3 * watcher.interval)
    assert not hasattr(watcher, "lost")
    watcher.stop()
