"""Rank liveness under torchrun: a heartbeat, so that a frozen rank stops the job.

Why: a rank that stops making progress (SIGSTOP, a hung host, a dead NIC) holds every
other rank inside its next collective until the collective timeout, 30 minutes by
default, with an error that names no rank. Here every rank runs a daemon thread that bumps
a counter in the rendezvous store every ``interval`` seconds and watches the others'
counters on its local monotonic clock (no cross-host clock comparison). A counter that
has not moved for ``stale_after`` seconds (half of ``distributed.timeout_s``) means that
process is not running at all: the watcher logs which rank, then ends its own process
with :data:`EXIT_RANK_LOST`, and torchrun tears the job down.

A thread keeps beating while the main thread computes, so long steps never trip it; a
rank whose process runs but whose device hangs is caught by the collective timeout
(``distributed.timeout_s``, passed to ``init_process_group``) instead.

On several nodes two more things live here, because a node that dies leaves no torchrun
behind to name its ranks: :meth:`Heartbeat.silent_peers` tells a rank whose collective
failed which peer stopped (rank, node, host), and :class:`StartupWatch` ends the ranks
waiting in ``init_process_group`` as soon as another node's rank announces that it stopped
before the job began (:func:`announce_startup_failure`).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta

log = logging.getLogger("portarl.runtime.distributed")

#: Exit status of a rank that stopped because another rank went silent (EX_TEMPFAIL).
EXIT_RANK_LOST = 75
_DONE = "done"


class Heartbeat:
    def __init__(self, store, rank: int, world_size: int, timeout_s: float, prefix: str = "portarl/heartbeat"):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = float(timeout_s)
        self.stale_after = self.timeout_s / 2
        self.interval = max(0.2, min(5.0, self.timeout_s / 20))
        self.prefix = prefix
        self._stop = threading.Event()
        #: The main thread is reporting a lost peer itself (silent_peers): the watcher keeps
        #: beating (so that other survivors do not take this rank for lost) but says nothing.
        self._reporting = False
        self._thread = threading.Thread(target=self._run, name="portarl-heartbeat", daemon=True)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def start(self) -> "Heartbeat":
        self.store.set(self._key(self.rank), "0")
        # Where this rank runs, for the line that names a lost peer (silent_peers): the node
        # (torchrun's agent number) and the host.
        self.store.set(f"{self.prefix}/where/{self.rank}", f"node {os.environ.get('GROUP_RANK', '0')}, host "
                       f"{socket.gethostname()}")
        self._thread.start()
        atexit.register(self.stop)  # a rank that exits normally is done, not frozen
        return self

    def stop(self) -> None:
        """This rank is done (normal exit): the others stop watching it."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 1)
        try:
            self.store.set(self._key(self.rank), _DONE)
        except Exception:  # the store may already be gone at exit
            pass

    def exit_barrier(self, timeout_s: float | None = None) -> bool:
        """Wait, through the store (no collective, so no tensor-bearing work left on the
        backend's threads), until every rank has reached its exit; ``False`` after
        ``timeout_s`` (default ``distributed.timeout_s``) if one never does."""
        key = f"{self.prefix}/exit"
        try:
            if int(self.store.add(key, 1)) >= self.world_size:
                self.store.set(f"{key}/all", "1")
                return True
            self.store.wait([f"{key}/all"], timedelta(seconds=timeout_s or self.timeout_s))
            return True
        except Exception:  # a peer died on its way out, or the launcher's store is gone
            return False

    def silent_peers(self, window_s: float | None = None) -> str | None:
        """Which peers stopped: the ranks whose heartbeat did not move over ``window_s``
        (default two and a half beats) and that did not finish, each with its node and host,
        e.g. "rank 1 (node 1, host b7)"; or that the rendezvous store itself stopped answering
        (it lives in the torchrun agent of the rendezvous endpoint's node, so that node is
        gone). ``None`` when every peer still beats.

        Why: a collective that fails because a peer's process ended says "Connection closed
        by peer" and nothing more. On one node the local torchrun names the failed rank; when
        a whole node dies, nobody else is left to say which one it was."""
        self._reporting = True
        window = window_s if window_s is not None else 2.5 * self.interval
        peers = [r for r in range(self.world_size) if r != self.rank]
        try:
            before = {r: self.store.get(self._key(r)) for r in peers}
            time.sleep(window)
            after = {r: self.store.get(self._key(r)) for r in peers}
            silent = [r for r in peers if after[r] == before[r] and after[r].decode() != _DONE]
            where = {r: self.store.get(f"{self.prefix}/where/{r}").decode() for r in silent}
        except Exception as err:  # the store is gone with the node that kept it
            endpoint = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            return (f"the rendezvous store at {endpoint} stopped answering ({type(err).__name__}), so the node of "
                    f"the rendezvous endpoint, which keeps it, is gone")
        if not silent:
            return None
        return ", ".join(f"rank {r} ({where[r]})" for r in silent) + \
            f" sent no heartbeat for {window:.1f} s"

    def _run(self) -> None:
        beat = 0
        now = time.monotonic()
        seen = {r: (None, now) for r in range(self.world_size) if r != self.rank}
        while not self._stop.wait(self.interval):
            beat += 1
            try:
                self.store.set(self._key(self.rank), str(beat))
                for r, (value, since) in list(seen.items()):
                    current = self.store.get(self._key(r)).decode() if self.store.check([self._key(r)]) else None
                    now = time.monotonic()
                    if current == _DONE:
                        del seen[r]
                    elif current != value:
                        seen[r] = (current, now)
                    elif now - since > self.stale_after and not self._reporting:
                        self._lost(f"rank {r} has sent no heartbeat for {now - since:.0f} s", r)
            except Exception as err:  # the store itself stopped answering
                if self._stop.is_set() or self._reporting:
                    return
                self._lost(f"the rendezvous store stopped answering ({type(err).__name__}: {err})", None)

    def _lost(self, what: str, rank: int | None) -> None:
        message = (f"portarl: {what} (distributed.timeout_s={self.timeout_s:g}): "
                   f"{'that rank is' if rank is not None else 'a rank or the launcher is'} frozen, stopped or its "
                   f"host is gone. Stopping rank {self.rank} so the job ends now instead of waiting in a collective; "
                   f"{_what_next()}.")
        log.error(message)
        print(message, file=sys.stderr, flush=True)
        from portarl.runtime import blackbox

        blackbox.declare(EXIT_RANK_LOST)  # an exit of its own (portarl.runtime.supervisor)
        os._exit(EXIT_RANK_LOST)


def _what_next() -> str:
    """What to run next: ``--resume`` unless the run's directory (recorded by the CLI,
    :mod:`portarl.runtime.blackbox`) is known to hold no checkpoint yet."""
    from portarl.runtime import blackbox
    from portarl.runtime.continuation import newest_checkpoint

    output_dir = blackbox.recorded("output_dir")
    if output_dir and newest_checkpoint(output_dir) is None:
        return ("there is no checkpoint yet: start the run again without --resume (with --overwrite once it has "
                "logged steps)")
    return "the newest checkpoint is intact, continue with --resume"


def start_heartbeat(rank: int, world_size: int, timeout_s: float) -> Heartbeat | None:
    """Connect a client of torchrun's rendezvous store (MASTER_ADDR / MASTER_PORT) and start
    beating; ``None`` when those are not set (not launched by torchrun)."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=max(1.0, timeout_s / 2)),
                          wait_for_workers=False)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return Heartbeat(store, rank, world_size, timeout_s, prefix=f"portarl/heartbeat/{run[0]}/{run[1]}").start()


def _startup_key() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"portarl/startup-failed/{run[0]}/{run[1]}"


def _store_client(timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def announce_startup_failure(code: int) -> None:
    """A rank of a job on several nodes that stops before it joined the process group (a
    config error, ``--resume`` with no checkpoint in this node's directory) says so in the
    rendezvous store, for :class:`StartupWatch` on the other nodes: without it, they would
    wait in ``init_process_group`` for ``distributed.timeout_s`` and end with a timeout that
    names no rank. Best effort: a store that cannot be reached changes nothing."""
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return
    try:
        _store_client(10.0).set(_startup_key(), f"rank {os.environ.get('RANK', '?')} (node "
                                f"{os.environ.get('GROUP_RANK', '?')}, host {socket.gethostname()}) stopped before "
                                f"the job began (exit status {code}); its own line, in that node's log, says why")
    except Exception:  # the store is gone: the other nodes' own timeout ends them
        pass


class StartupWatch:
    """While this rank waits in ``init_process_group`` for the others: a daemon thread that
    ends this rank, with one line, as soon as another node's rank announces that it stopped
    before the job began (:func:`announce_startup_failure`). Stopped and joined by :meth:`stop`."""

    def __init__(self, rank: int, poll_s: float = 0.5):
        self.rank, self.poll_s = rank, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="portarl-startup-watch", daemon=True)

    def start(self) -> "StartupWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        key = _startup_key()
        try:
            store = _store_client(max(1.0, self.poll_s * 4))
            while not self._stop.wait(self.poll_s):
                if store.check([key]):
                    what = store.get(key).decode()
                    break
            else:
                return
        except Exception:  # no store to watch: the process group's own timeout applies
            return
        if self._stop.is_set():  # the job began after all
            return
        print(f"portarl train: rank {self.rank}: {what}; stopping this rank too", file=sys.stderr, flush=True)
        from portarl.runtime import blackbox

        blackbox.declare(2)
        os._exit(2)
