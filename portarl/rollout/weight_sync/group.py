"""The weight-sync group: the trainer's rank 0 (rank 0 here, the sender) and N receivers.

Why a group of its own and not the trainer's process group: the receivers (rollout workers,
vLLM engines) are not ranks of the training job, start later, and may run in another
environment. The group is built from two planes:

- **control**: a ``TCPStore`` hosted by rank 0 (port 0 picks a free one; receivers are
  told the port). Headers, commit records, acknowledgements and liveness go through it,
  as small JSON values. A receiver never posts a collective before the sender has
  announced the bucket in the store, so a long training step between versions never
  holds anyone inside a collective;
- **data**: the bucket buffers, broadcast from rank 0 through a communicator: Gloo over
  TCP on the CPU (``comm="gloo"``, a ``ProcessGroupGloo`` built on the store, outside
  ``torch.distributed``'s global state), or the device's own collective library through
  vLLM's stateless group (``comm="nccl"``: ``PyNcclCommunicator``; ``comm="hccl"``:
  vllm-ascend's ``PyHcclCommunicator``; :mod:`portarl.rollout.weight_sync.device_comm`).

Liveness, not deadlines: measured here, a Gloo receiver whose sender is SIGKILLed in the
middle of a broadcast does not fail until the collective's timeout runs out (30 s of a 30 s
timeout: no connection error reaches it). So every rank bumps a counter in the store from a
thread every ``interval`` seconds, and every wait (for a header, for a transfer, for the
acknowledgements) polls the peers it waits on: a peer that marked itself failed, a counter
that has not moved for ``stale_after_s`` on this process's monotonic clock, or a store
that stopped answering (its host, rank 0, is gone) ends the wait at once with
:class:`PeerLost`. A slow peer that is alive is waited for; the communicator's own timeout
(``timeout_s``, :data:`portarl.runtime.distributed.DEFAULT_TIMEOUT_S` by default) only bounds one
bucket's transfer, the same margin as the trainer's collectives.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from portarl.runtime.distributed import DEFAULT_TIMEOUT_S

log = logging.getLogger("portarl.rollout")

PREFIX = "portarl/weight-sync"
#: A rank's state key holds this once it closed normally.
CLOSED = "closed"
COMMS = ("gloo", "nccl", "hccl")


class WeightSyncError(RuntimeError):
    """The weight-sync group cannot go on (a peer failed, a version was torn)."""


class PeerLost(WeightSyncError):
    """A rank of the group died, froze, gave up or closed while another waited on it
    (``rank``: which one; ``None`` where the store itself stopped answering)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def liveness_timing(timeout_s: float) -> tuple[float, float]:
    """``(interval, stale_after)`` for ``timeout_s``: the numbers of the trainer's own rank
    heartbeat (:mod:`portarl.runtime.heartbeat`): beat every ``timeout_s / 20`` (0.2-5 s), a peer is
    lost after ``timeout_s / 2`` without a beat."""
    return max(0.2, min(5.0, timeout_s / 20)), timeout_s / 2


class _Beat(threading.Thread):
    """Bumps this rank's counter in the store every ``interval`` seconds (its own client
    connection, so the main thread's store calls never wait behind it)."""

    def __init__(self, host: str, port: int, key: str, interval: float, timeout_s: float):
        super().__init__(name="portarl-weight-sync-beat", daemon=True)
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.key, self.interval = key, interval
        self.stop_event = threading.Event()

    def run(self) -> None:
        beat = 0
        while True:
            beat += 1
            try:
                self.store.set(self.key, str(beat))
            except Exception:  # the store's host is gone: the waits report it
                return
            if self.stop_event.wait(self.interval):
                return


class SyncGroup:
    """One rank of a weight-sync group (rank 0 sends and hosts the store).

    ``host`` / ``port``: where rank 0's store listens (rank 0 may pass ``port=0`` and read
    :attr:`port` afterwards). ``world_size``: 1 sender + the receivers. ``timeout_s``: the
    bound of one bucket's transfer and of joining; ``stale_after_s`` (default
    ``timeout_s / 2``): how long a peer may show no sign of life.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 stale_after_s: float | None = None, comm: str = "gloo", device: torch.device | str | None = None):
        if world_size < 2:
            raise ValueError(f"a weight-sync group needs the sender and at least one receiver, world_size={world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group of {world_size}")
        if comm not in COMMS:
            raise ValueError(f"weight-sync comm {comm!r} is not one of {', '.join(COMMS)}")
        if comm != "gloo" and device is None:
            raise ValueError(f"weight-sync comm={comm!r} needs the device its buffers live on")
        self.rank, self.world_size, self.comm_kind = rank, world_size, comm
        self.timeout_s = float(timeout_s)
        self.interval, default_stale = liveness_timing(self.timeout_s)
        self.stale_after_s = float(stale_after_s) if stale_after_s is not None else default_stale
        self.store = dist.TCPStore(host, port, is_master=rank == 0, timeout=timedelta(seconds=self.timeout_s),
                                   wait_for_workers=False)
        self.host, self.port = host, self.store.port
        self._seen: dict[int, tuple[str | None, float]] = {}
        self._closed = False
        self._beat = _Beat(host, self.port, self._beat_key(rank), self.interval, self.timeout_s)
        self._beat.start()
        self._device = device
        self._comm = None

    @property
    def device(self) -> torch.device:
        """Where bucket buffers live: the host for Gloo, the accelerator for NCCL / HCCL."""
        return torch.device("cpu") if self.comm_kind == "gloo" else torch.device(self._device)

    @property
    def comm(self):
        """The data-plane communicator, joined on first use (:meth:`connect`)."""
        if self._comm is None:
            self.connect()
        return self._comm

    def connect(self) -> None:
        """Join the communicator once every rank is up. The wait for the others is governed by
        liveness (a rank that never starts is lost after ``stale_after_s``), not a deadline:
        a vLLM worker may take minutes to start on a loaded machine. Rank 0 can publish
        :attr:`port` before calling this, so receivers can find the store."""
        if self._comm is not None:
            return
        peers = self.receivers if self.rank == 0 else [0]
        self.wait_until(lambda: True if all(self.store.check([self._beat_key(r)]) for r in peers) else None, peers,
                        "the other ranks to join")
        try:
            if self.comm_kind == "gloo":
                from portarl.rollout.weight_sync.device_comm import GlooComm

                self._comm = GlooComm(self.store, self.rank, self.world_size, self.timeout_s)
            else:
                from portarl.rollout.weight_sync.device_comm import vllm_device_comm

                self._comm = vllm_device_comm(self.comm_kind, self.store, self.rank, self.world_size, self._device)
        except BaseException:
            self.fail("could not join the communicator")
            raise

    # --------------------------------------------------------------- keys
    @staticmethod
    def _beat_key(rank: int) -> str:
        return f"{PREFIX}/beat/{rank}"

    @staticmethod
    def _state_key(rank: int) -> str:
        return f"{PREFIX}/state/{rank}"

    @staticmethod
    def key(*parts) -> str:
        return "/".join([PREFIX, *map(str, parts)])

    @property
    def receivers(self) -> list[int]:
        return list(range(1, self.world_size))

    # ----------------------------------------------------------- liveness
    def check_peers(self, ranks, what: str = "") -> None:
        """Raise :class:`PeerLost` if one of ``ranks`` gave up, closed, stopped beating for
        ``stale_after_s`` or the store itself stopped answering (``what``: what this rank
        was waiting for, for the message)."""
        try:
            self._check_peers(ranks)
        except PeerLost as err:
            raise PeerLost(f"{err} (while waiting for {what})" if what else str(err), err.rank) from None

    def _check_peers(self, ranks) -> None:
        now = time.monotonic()
        try:
            for r in ranks:
                if self.store.check([self._state_key(r)]):
                    state = self.store.get(self._state_key(r)).decode()
                    what = "closed the group" if state == CLOSED else f"gave up: {state}"
                    raise PeerLost(f"weight sync: rank {r} {what}", r)
                beat = self.store.get(self._beat_key(r)).decode() if self.store.check([self._beat_key(r)]) else None
                last, since = self._seen.get(r, (None, now))
                if beat != last or r not in self._seen:
                    self._seen[r] = (beat, now)
                elif now - since > self.stale_after_s:
                    raise PeerLost(f"weight sync: rank {r} has shown no sign of life for {now - since:.0f} s "
                                   f"(stale_after_s={self.stale_after_s:g}): its process is stopped, frozen or gone", r)
        except PeerLost:
            raise
        except Exception as err:  # connection refused / reset: rank 0, the store's host, is gone
            raise PeerLost(f"weight sync: the group's store (hosted by rank 0) stopped answering "
                           f"({type(err).__name__}: {err}); the sender's process is gone") from None

    def wait_until(self, ready, peers, what: str):
        """Poll ``ready()`` until it returns a value other than ``None`` (returned), checking
        ``peers`` between polls; the polling interval grows from 0.5 ms to 20 ms.

        ``peers`` may be a list that ``ready()`` shrinks as peers deliver their share (the
        sender's acknowledgements). A peer found closed or failed is lost only if, polled
        *after* its state was read, it still owes its share: a rank writes what it delivers
        before it closes, through the same store connection, and the store applies one
        connection's writes in order, so a close that is visible means whatever that rank
        wrote before it is visible too. Re-polling then keeps a peer that delivered and
        left from being reported lost, whatever the other peers still owe."""
        pause, next_check = 0.0005, 0.0
        while True:
            if self._closed:  # closed from another thread (a receiver's inbox at exit)
                raise WeightSyncError(f"weight sync: rank {self.rank} closed the group while waiting for {what}")
            try:
                value = ready()
            except WeightSyncError:
                raise
            except Exception as err:  # the store or the transfer failed: a lost peer explains it best
                self.check_peers(peers, what)
                raise PeerLost(f"weight sync: waiting for {what} failed ({type(err).__name__}: {err})") from None
            if value is not None:
                return value
            now = time.monotonic()
            if now >= next_check:
                try:
                    self.check_peers(peers, what)
                except PeerLost as lost:  # it may have delivered, then left, since ready() was polled
                    try:
                        value = ready()
                    except WeightSyncError:
                        raise
                    except Exception:  # the transfer it was part of failed with it: the loss explains it
                        raise lost from None
                    if value is not None:
                        return value
                    if lost.rank is None or lost.rank in peers:
                        raise
                    continue  # it delivered its share before it left: check the others at once
                next_check = now + min(self.interval, 1.0)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def wait_key(self, key: str, peers, what: str) -> bytes:
        return self.wait_until(lambda: self.store.get(key) if self.store.check([key]) else None, peers, what)

    def start_broadcast(self, flat: torch.Tensor):
        """Start broadcasting ``flat`` (any dtype, sent as its bytes) from rank 0; returns
        the completion poll for :meth:`wait_broadcast`."""
        return self.comm.broadcast(flat)

    def wait_broadcast(self, done, peers, what: str) -> None:
        self.wait_until(lambda: True if done() else None, peers, what)

    def broadcast(self, flat: torch.Tensor, peers, what: str) -> None:
        """Broadcast ``flat`` from rank 0 and wait for it, watching ``peers``."""
        self.wait_broadcast(self.start_broadcast(flat), peers, what)

    # ------------------------------------------------------------- ending
    def fail(self, reason: str) -> None:
        """Mark this rank failed (peers stop waiting on it at their next check) and abort
        the communicator; the group cannot be used again."""
        if self._closed:
            return
        self._closed = True
        try:
            self.store.set(self._state_key(self.rank), reason[:2000])
        except Exception:
            pass
        if self._comm is not None:
            self._comm.abort()
        self._stop_beat()

    def close(self) -> None:
        """Leave the group normally (idempotent). Receivers close before rank 0: rank 0
        hosts the store."""
        if self._closed:
            return
        self._closed = True
        try:
            self.store.set(self._state_key(self.rank), CLOSED)
        except Exception:
            pass
        if self._comm is not None:
            self._comm.abort()
        self._stop_beat()

    @property
    def closed(self) -> bool:
        return self._closed

    def _stop_beat(self) -> None:
        self._beat.stop_event.set()
        if self._beat.is_alive() and self._beat is not threading.current_thread():
            self._beat.join(timeout=2 * self.interval + 1)
