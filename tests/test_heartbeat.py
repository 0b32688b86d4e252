"""The heartbeat's logic in one process (the 2-process SIGSTOP test is in tests/distributed).

Load-proof: "within the limit" is counted in the watcher's own beats (each waits at least one
interval), not in wall-clock seconds, which a busy machine stretches; the waits for an event
are long (slow is fine) and end as soon as it happens."""

from __future__ import annotations

import time

import torch.distributed as dist

from portarl.runtime.heartbeat import Heartbeat


class _Recorder(Heartbeat):
    def _lost(self, what, rank):  # instead of ending the process
        self.lost = (what, rank, time.monotonic())
        self._stop.set()


class _CountingStore:
    """The store the heartbeats share, counting each key's writes (a rank's beats)."""

    def __init__(self):
        self.inner, self.writes = dist.HashStore(), {}

    def set(self, key, value):
        self.writes[key] = self.writes.get(key, 0) + 1
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def check(self, keys):
        return self.inner.check(keys)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def wait(self, keys, timeout):
        return self.inner.wait(keys, timeout)


def _pair(timeout_s=2.0):
    store = _CountingStore()
    return [_Recorder(store, r, 2, timeout_s) for r in (0, 1)]


def _wait_for(condition, what: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_silent_rank_is_named_within_the_limit():
    watcher, frozen = _pair()
    store = watcher.store
    watcher.start(), frozen.start()
    _wait_for(lambda: store.writes.get(frozen._key(1), 0) >= 3, "the second rank never beat")
    frozen._stop.set()  # its thread stops beating, as a SIGSTOPped process would
    frozen._thread.join()
    beats_at_freeze = store.writes[watcher._key(0)]
    _wait_for(lambda: hasattr(watcher, "lost"), "the silent rank was never reported")
    what, rank, _ = watcher.lost
    assert rank == 1 and what.startswith("rank 1 has sent no heartbeat")
    # Named within the limit: at most stale_after / interval beats of the watcher after the
    # last beat it saw, plus the beat that saw it and the one that judged it.
    beats_after = store.writes[watcher._key(0)] - beats_at_freeze
    assert beats_after <= watcher.stale_after / watcher.interval + 2, beats_after
    assert not watcher.lost[0].startswith("rank 1 has sent no heartbeat for 0 s")


def test_a_rank_that_finished_is_not_reported():
    watcher, done = _pair()
    store = watcher.store
    watcher.start(), done.start()
    _wait_for(lambda: store.writes.get(done._key(1), 0) >= 2, "the second rank never beat")
    done.stop()  # normal exit: marks itself done
    # Long enough for the watcher to have judged it silent: its own beats, not wall time.
    beats = store.writes[watcher._key(0)]
    _wait_for(lambda: store.writes[watcher._key(0)] - beats > watcher.stale_after / watcher.interval + 3,
              "the watcher stopped beating")
    assert not hasattr(watcher, "lost")
    watcher.stop()


def test_exit_barrier_releases_when_every_rank_arrived_and_not_before():
    import threading

    first, second = _pair(timeout_s=600.0)  # not started: the barrier needs only the store
    results = {}
    waiter = threading.Thread(target=lambda: results.setdefault("first", first.exit_barrier()))
    waiter.start()
    _wait_for(lambda: first.store.inner.check([f"{first.prefix}/exit"]), "the first rank never arrived")
    assert waiter.is_alive()  # held: the second rank is not there yet
    assert second.exit_barrier() is True
    waiter.join()
    assert results == {"first": True}


def test_exit_barrier_gives_up_on_a_peer_that_never_comes():
    alone, _ = _pair(timeout_s=600.0)
    assert alone.exit_barrier(timeout_s=0.2) is False


def test_silent_peers_names_the_rank_that_stopped_with_its_node_and_host(monkeypatch):
    """What a rank whose collective failed says of its peers (portarl/cli/train.py, several
    nodes): the rank whose beats stopped, where it ran; nothing while every peer beats."""
    import socket

    monkeypatch.setenv("GROUP_RANK", "1")  # what torchrun sets on the second node
    watcher, other = _pair()
    watcher.start(), other.start()
    store = watcher.store
    _wait_for(lambda: store.writes.get(other._key(1), 0) >= 2, "the second rank never beat")
    # Every peer beats: none named (a generous window: dozens of beats, so load cannot fail it).
    assert watcher.silent_peers(window_s=25 * watcher.interval) is None
    other._stop.set()  # its beats stop, as a killed node's do
    other._thread.join()
    said = watcher.silent_peers()
    assert said == f"rank 1 (node 1, host {socket.gethostname()}) sent no heartbeat for {2.5 * watcher.interval:.1f} s"
    watcher.stop()


def test_silent_peers_says_when_the_rendezvous_store_is_gone(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "node0.example")
    monkeypatch.setenv("MASTER_PORT", "29400")
    watcher, _ = _pair()
    watcher.store = type("Gone", (), {"get": lambda self, key: (_ for _ in ()).throw(ConnectionError("reset"))})()
    said = watcher.silent_peers(window_s=0.0)
    assert said.startswith("the rendezvous store at node0.example:29400 stopped answering (ConnectionError)"), said
