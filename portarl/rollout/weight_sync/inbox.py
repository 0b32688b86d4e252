"""The receiving end of ``rollout.weight_sync: collective`` in a rollout process.

The async worker handles its requests strictly in order and may be generating a batch
when the trainer publishes the next version; the trainer must not wait for that batch to
end. So a thread of its own (:class:`VersionInbox`) takes part in every broadcast as soon
as the trainer sends, and keeps each version that arrived *whole* (the commit record
matched what was staged, :class:`~portarl.rollout.weight_sync.WeightReceiver`) until the
worker's ``weights`` request takes it (:meth:`VersionInbox.take`) and loads it into its
model (:func:`load_version`) between two batches. A torn version is never staged: the
thread records the refusal, the worker stays on the version it loaded last, and a later
``take`` raises it.

Memory: a staged version is one copy of the weights until it is taken (at most
``max_staleness + 1`` of them while the worker finishes the batches in flight); taking
version v drops every older one. Over Gloo they are in host memory. Over NCCL / HCCL a
version arrives in the worker's device memory, and only the newest stays there: an older
one still waiting is moved to host memory when the next arrives, so the device holds at
most one staged copy beside the model and its engine (``portarl plan`` counts it).
"""

from __future__ import annotations

import logging
import threading

import torch

from portarl.rollout.weight_sync.group import SyncGroup, WeightSyncError
from portarl.rollout.weight_sync.protocol import WeightReceiver

log = logging.getLogger("portarl.rollout.worker")


class VersionInbox:
    """Rank ``rank`` of the weight-sync group hosted by the trainer at ``host:port``; a
    thread receives every version into :attr:`staged`."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, comm: str = "gloo",
                 device=None):
        self.group = SyncGroup(host, port, rank, world_size, timeout_s=timeout_s, comm=comm, device=device)
        self.receiver = WeightReceiver(self.group, loaded=-1)  # the trainer's first version is 0
        self._cond = threading.Condition()
        self._staged: dict[int, dict] = {}
        self._error: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="portarl-weight-inbox", daemon=True)
        self._thread.start()

    def _stage(self, version: int, tensors: dict) -> None:
        with self._cond:
            if self.group.comm_kind != "gloo":  # one staged version on the device: the newest
                for older, staged in self._staged.items():
                    if any(t.device.type != "cpu" or t.untyped_storage().nbytes() > t.nbytes for t in staged.values()):
                        # each tensor copied out of the bucket buffers, which are then freed
                        self._staged[older] = {name: t.to("cpu", copy=True) for name, t in staged.items()}
            self._staged[version] = tensors
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            try:
                version, _, stats = self.receiver.receive(load=self._stage)
            except BaseException as err:  # a torn version, a lost trainer, or close()
                with self._cond:
                    self._error = err
                    self._cond.notify_all()
                if not self._closing:
                    log.error("rollout worker: weight sync stopped: %s", err)
                return
            log.info("rollout worker: weights version %d arrived whole (%d buckets, %.1f MB, %.3f s on the wire)",
                     version, stats.buckets, stats.bytes / 1e6, stats.transfer_seconds)

    def take(self, version: int) -> dict:
        """The tensors of ``version`` once it arrived whole (older staged versions are
        dropped), or the error that stopped the inbox (a torn version: nothing of it is
        returned)."""
        with self._cond:
            while version not in self._staged and self._error is None:
                self._cond.wait()
            if version not in self._staged:
                raise WeightSyncError(f"weights version {version} never arrived whole: {self._error}")
            tensors = self._staged.pop(version)
            for older in [v for v in self._staged if v < version]:
                del self._staged[older]
            return tensors

    def close(self) -> None:
        """Leave the group (before the trainer, which hosts its store) and join the thread."""
        self._closing = True
        self.group.close()
        self._thread.join()


def load_version(model: torch.nn.Module, tensors: dict, skip: set[str]) -> None:
    """Copy a received version into ``model``: every parameter and buffer of its state dict
    but the tied twins ``skip`` (filled through the tensor they share), with the name,
    shape and dtype it has (no cast: the worker must sample exactly the trainer's weights)."""
    state = model.state_dict()
    missing = sorted(set(state) - set(tensors) - skip)
    unexpected = sorted(set(tensors) - set(state))
    if missing or unexpected:
        raise ValueError(f"weight sync: the version does not match the worker's model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, tensor in tensors.items():
        own = state[name]
        if own.dtype != tensor.dtype or own.shape != tensor.shape:
            raise ValueError(f"weight sync: {name} arrived as {tensor.dtype} {tuple(tensor.shape)}, the worker's is "
                             f"{own.dtype} {tuple(own.shape)}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)
