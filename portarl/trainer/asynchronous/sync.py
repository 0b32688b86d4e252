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

The data plane (``rollout.sync_comm``, :func:`choose_comm`): Gloo through host memory, or,
where every worker has an accelerator of its own (``rollout.worker_devices``) of the
trainer's type, device to device through vLLM's NCCL (vllm-ascend's HCCL) communicator
(:mod:`portarl.rollout.weight_sync.device_comm`): rank 0 packs the buckets on its device
from tensors gathered and cast there, and the worker stages them in its device's memory.
A communicator takes one rank per device, so a worker on rank 0's device (the default:
no ``rollout.worker_devices``) syncs over Gloo. The NCCL / HCCL path is written against
vLLM's API and has run here only over a stand-in communicator (no GPU or NPU on this
machine): its first hardware run must check it.

Fault injection for the tests (``PORTARL_WEIGHT_SYNC_FAULT=stop@V:N``): the sender stops
with an error after sending ``N`` buckets of version ``V``, as if it died mid-version.
"""

from __future__ import annotations

import os

import importlib.util
import logging

import torch

from portarl.runtime.errors import ConfigError
from portarl.rollout.weight_sync import SyncGroup, WeightSender

log = logging.getLogger("portarl.trainer")

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


#: device type -> (its communicator, the packages that provide it)
DEVICE_COMMS = {"cuda": ("nccl", ("vllm",)), "npu": ("hccl", ("vllm", "vllm_ascend"))}


def choose_comm(setting: str, trainer_device: torch.device, worker_devices: list | None) -> tuple[str, str]:
    """``(comm, why)``: what carries the weights for ``rollout.sync_comm=setting`` with the
    trainer's rank 0 on ``trainer_device`` and the workers on ``worker_devices`` (the
    trainer's numbering; None: on the trainer's device). ``auto`` takes the device's
    communicator where it can run and Gloo otherwise; ``nccl`` / ``hccl`` where it cannot
    is a :class:`ConfigError` naming why and the fix."""
    from portarl.backends.device import placed as placed_on

    def fallback(why: str) -> tuple[str, str]:
        if setting != "auto":
            raise ConfigError(f"rollout.sync_comm={setting} cannot run here: {why}; set rollout.sync_comm=auto "
                              "(Gloo through host memory where the device path cannot run) or gloo")
        return "gloo", why

    if setting == "gloo":
        return "gloo", "rollout.sync_comm=gloo"
    kind = trainer_device.type
    if kind not in DEVICE_COMMS:
        return fallback(f"the trainer runs on {kind}")
    comm, packages = DEVICE_COMMS[kind]
    if setting not in ("auto", comm):
        return fallback(f"the trainer runs on {kind}, whose communicator is {comm}")
    if not worker_devices:
        return fallback("the workers run on the trainer's device (no rollout.worker_devices), and a communicator "
                        "takes one rank per device")
    own = (kind, trainer_device.index or 0)
    placed = [placed_on(d) for d in worker_devices]
    if any(k != kind for k, _ in placed):
        return fallback(f"rollout.worker_devices {worker_devices} are not all {kind} devices")
    if own in placed:
        return fallback(f"a worker is on rank 0's own device {kind}:{own[1]} (rollout.worker_devices {worker_devices})")
    if len(set(placed)) < len(placed):
        return fallback(f"two workers share a device (rollout.worker_devices {worker_devices})")
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        return fallback(f"{' and '.join(missing)} is not installed (its {comm} communicator carries the weights)")
    return comm, f"{kind}:{own[1]} to {', '.join(f'{k}:{i}' for k, i in placed)}, device to device"


class CollectiveSync:
    """The sender's end: the group (hosted here) and :meth:`send`. ``comm`` / ``device``:
    the data plane and rank 0's device (:func:`choose_comm`)."""

    def __init__(self, bucket_mb: float, timeout_s: float, workers: int = 1, comm: str = "gloo",
                 device: torch.device | None = None):
        self.fault = _fault()
        self.group = SyncGroup(HOST, 0, 0, workers + 1, timeout_s=timeout_s, comm=comm, device=device)
        self.sender = WeightSender(self.group, bucket_mb=bucket_mb)

    @classmethod
    def for_run(cls, cfg, device: torch.device) -> CollectiveSync:
        """The group of a run whose rank 0 trains on ``device``; the data plane chosen and logged."""
        r = cfg.rollout
        comm, why = choose_comm(r.sync_comm, device, r.worker_devices)
        log.info("async weight sync over %s (%s)", comm, why)
        return cls(r.sync_bucket_mb, r.timeout_s, r.num_workers, comm=comm, device=device)

    def spec(self, worker: int) -> dict:
        """What worker ``worker`` (0-based) needs to join (its spec's ``weight_sync``); it
        stages on its own device with ``comm`` other than gloo."""
        return {"host": HOST, "port": self.group.port, "timeout_s": self.group.timeout_s, "rank": worker + 1,
                "world_size": self.group.world_size, "comm": self.group.comm_kind}

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
