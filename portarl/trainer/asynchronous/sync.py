"""``rollout.weight_sync: collective``: the trainer's end of the weight sync with the async
rollout worker (the worker's end: :class:`~portarl.rollout.weight_sync.inbox.VersionInbox`).

Rank 0 hosts a weight-sync group (itself, the sender, and every worker) on a store
bound to the loopback interface (the worker is its child, on its host), and sends every
version with :class:`~portarl.rollout.weight_sync.WeightSender`: buckets of
``rollout.sync_bucket_mb``, a JSON header each, the commit record last. It does not wait
there for the transfer to end or for the worker's acknowledgement that the version arrived
whole: the worker's receiving thread takes part in the broadcast and acknowledges when it
gets the GIL from its generating main thread (16-19 ms of the trainer's step on the demo
model, measured; bench/results/async-publish.md), so :meth:`CollectiveSync.send` waits for
the previous version's (:meth:`~portarl.rollout.weight_sync.WeightSender.settle`), a step
later, and leaves its own on the wire from a buffer of its own (``defer``). The
guarantees are the receiver's and unchanged: the worker loads a version at its ``weights``
request only once it arrived whole (:class:`~portarl.rollout.weight_sync.inbox.VersionInbox`),
so no batch is generated with a version still on the wire. A send that fails midway leaves
a torn version the worker refuses; a worker that refused, failed or died is reported by the
next send (or, sooner, by the wait for its batch); the caller stops the run with a
checkpoint.

The data plane is Gloo over host memory. The worker runs on the trainer's own device
(``rollout.mode: async`` gives it no device of its own yet), and NCCL refuses two ranks on
one GPU, so a device-to-device path (NCCL / HCCL through vLLM's stateless group,
:mod:`portarl.rollout.weight_sync.device_comm`) only applies once workers get devices of
their own: written, not run here (no GPU or NPU on this machine).

Fault injection for the tests (``PORTARL_WEIGHT_SYNC_FAULT=stop@V:N``): the sender stops
with an error after sending ``N`` buckets of version ``V``, as if it died mid-version.
"""

from __future__ import annotations

import os

from portarl.rollout.weight_sync import SyncGroup, WeightSender

FAULT_ENV = "PORTARL_WEIGHT_SYNC_FAULT"
HOST = "127.0.0.1"


class SenderStopped(RuntimeError):
    """Fault injection: the sender stopped mid-version."""


def _fault() -> tuple[int, int] | None:
    text = os.environ.get(FAULT_ENV)
    if not text:
        return None
    kind, _, where = text.partition("@")
    version, _, buckets = where.partition(":")
    if kind != "stop" or not version or not buckets:
        raise ValueError(f"{FAULT_ENV}={text!r}: expected stop@VERSION:BUCKETS")
    return int(version), int(buckets)


class CollectiveSync:
    """The sender's end: the group (hosted here) and :meth:`send`."""

    def __init__(self, bucket_mb: float, timeout_s: float, workers: int = 1):
        self.fault = _fault()
        self.group = SyncGroup(HOST, 0, 0, workers + 1, timeout_s=timeout_s)
        self.sender = WeightSender(self.group, bucket_mb=bucket_mb)

    def spec(self, worker: int) -> dict:
        """What worker ``worker`` (0-based) needs to join (its spec's ``weight_sync``)."""
        return {"host": HOST, "port": self.group.port, "timeout_s": self.group.timeout_s, "rank": worker + 1,
                "world_size": self.group.world_size}

    def send(self, version: int, items):
        """Send ``items`` (``(name, tensor)`` pairs, consumed once) as ``version`` once the previous version
        was acknowledged whole by every worker; returns its SyncStats with the last bucket
        still on the wire (settled by the next send)."""
        def on_bucket(index, names):
            if self.fault is not None and self.fault == (version, index):
                raise SenderStopped(f"fault injection ({FAULT_ENV}): the sender stopped after {index} buckets of "
                                    f"version {version}")

        return self.sender.send(version, items, defer=True, on_bucket=on_bucket)

    def close(self) -> None:
        """Leave the group (after the worker: this rank hosts the store)."""
        self.group.close()
