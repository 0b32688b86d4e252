"""Sending and receiving weight versions over a :class:`~portarl.rollout.weight_sync.group.SyncGroup`.

One version is one *round* (numbered from 1 on both sides, in step):

1. for each bucket (:mod:`~portarl.rollout.weight_sync.buckets`): the sender packs it, puts
   its JSON header in the store under ``round/<r>/bucket/<i>``, and broadcasts the buffer;
   each receiver waits for the header (watching the sender's liveness), checks it, and
   takes part in the broadcast into a fresh staging buffer;
2. the sender puts the commit record (version, bucket count, bytes, tensor count) under
   ``round/<r>/commit``;
3. each receiver checks the commit against what it staged; only then does it hand the
   version to its ``load`` callable (vLLM's in-place reload, a plain model's
   ``load_state_dict``) and acknowledge (``round/<r>/ack/<rank>``, one key per receiver,
   which the sender may wait for).

So a receiver loads a version whole or not at all: a sender that dies, fails or is killed
in the middle of a bucket leaves no commit, the receiver raises :class:`TornVersion`
naming the version it refused and the one it kept, and nothing was loaded. The group is
then closed (a collective cut in the middle leaves the communicator unusable); the
caller decides what follows (the run stops with a checkpoint).

Cost: the staging buffers are one extra copy of the version on the receiver (host memory
for Gloo, device memory for NCCL / HCCL) while it arrives; they are freed once loaded.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from portarl.rollout.weight_sync.buckets import (
    WireFormatError,
    buckets_of,
    check_commit,
    commit_record,
    crc32,
    header,
    parse_header,
    unpack,
)
from portarl.rollout.weight_sync.group import PeerLost, SyncGroup, WeightSyncError

#: Default bucket size (``rollout.sync_bucket_mb``).
DEFAULT_BUCKET_MB = 256


class TornVersion(WeightSyncError):
    """A version that did not arrive whole; the receiver kept its previous version."""

    def __init__(self, version, kept: int, reason: str):
        self.version, self.kept, self.reason = version, kept, reason
        what = f"version {version}" if version is not None else "the next version"
        super().__init__(f"weight sync: {what} arrived torn and was refused ({reason}); this receiver keeps version "
                         f"{kept}. The group is closed: the sender stopped or failed mid-version.")


@dataclasses.dataclass
class SyncStats:
    version: int
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    pack_seconds: float = 0.0
    transfer_seconds: float = 0.0
    ack_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class WeightSender:
    """Rank 0 of a group: publishes versions. ``bucket_mb``: bucket size in MiB;
    ``checksum``: add a CRC-32 of every bucket (host buffers only; ~1.7 GB/s per side here,
    so off by default: the counts in the commit record already catch a torn version)."""

    def __init__(self, group: SyncGroup, bucket_mb: float = DEFAULT_BUCKET_MB, checksum: bool = False):
        if group.rank != 0:
            raise ValueError(f"the sender is rank 0 of the weight-sync group, not rank {group.rank}")
        if bucket_mb <= 0:
            raise ValueError(f"rollout.sync_bucket_mb must be positive, got {bucket_mb}")
        if checksum and group.device.type != "cpu":
            raise ValueError("weight-sync checksum=True needs host buffers (comm='gloo')")
        self.group, self.checksum = group, checksum
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.round = 0
        self.version: int | None = None
        self._last_buckets = 0
        self._buffers: list = [None, None]

    def _buffer(self, slot: int):
        """Two reusable pack buffers of one bucket each: bucket ``i + 1`` is packed into one
        while bucket ``i`` is sent from the other (no fresh allocation per bucket)."""
        if self._buffers[slot] is None or self._buffers[slot].numel() < self.bucket_bytes:
            self._buffers[slot] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.group.device)
        return self._buffers[slot]

    def send(self, version: int, items, *, wait_ack: bool = True, on_bucket=None) -> SyncStats:
        """Publish ``items`` (``(name, tensor)`` pairs, consumed once, in order) as
        ``version``; with ``wait_ack`` return once every receiver loaded it. ``on_bucket(i, names)``
        is called before bucket ``i`` is broadcast (fault injection in tests)."""
        if self.group.closed:
            raise WeightSyncError("weight sync: the group is closed")
        if self.version is not None and version <= self.version:
            raise ValueError(f"weight versions must increase: {version} after {self.version}")
        group, peers = self.group, self.group.receivers
        self.round += 1
        r = self.round
        stats = SyncStats(version)
        start = time.perf_counter()
        try:
            if r > 2:  # every receiver finished round r-2 before it took part in round r-1
                for key in (group.key("round", r - 2, "commit"),
                            *(group.key("round", r - 2, "ack", p) for p in peers)):
                    group.store.delete_key(key)
            pending = None  # the bucket on the wire while the next one is packed (double buffering)
            for index, bucket in enumerate(buckets_of(items, self.bucket_bytes)):
                t0 = time.perf_counter()
                flat = bucket.pack(group.device, out=self._buffer(index % 2))
                check = crc32(flat) if self.checksum else None
                stats.pack_seconds += time.perf_counter() - t0
                if on_bucket is not None:
                    on_bucket(index, bucket.names)
                t0 = time.perf_counter()
                if pending is not None:
                    pending()
                group.store.set(group.key("round", r, "bucket", index), header(r, version, index, bucket, check))
                done = group.start_broadcast(flat)
                pending = lambda done=done, index=index, flat=flat: group.wait_broadcast(  # noqa: E731
                    done, peers, f"the transfer of bucket {index} of version {version}")
                stats.transfer_seconds += time.perf_counter() - t0
                if r > 1:
                    group.store.delete_key(group.key("round", r - 1, "bucket", index))
                stats.buckets += 1
                stats.tensors += len(bucket.names)
                stats.bytes += bucket.nbytes
            if pending is not None:
                t0 = time.perf_counter()
                pending()
                stats.transfer_seconds += time.perf_counter() - t0
            if not stats.buckets:
                raise ValueError(f"weight version {version} has no tensors")
            for index in range(stats.buckets, self._last_buckets if r > 1 else 0):
                group.store.delete_key(group.key("round", r - 1, "bucket", index))
            self._last_buckets = stats.buckets
            group.store.set(group.key("round", r, "commit"),
                            commit_record(r, version, stats.buckets, stats.bytes, stats.tensors))
            self.version = version
            if wait_ack:
                t0 = time.perf_counter()
                wait_for_acknowledgements(group, r, version)
                stats.ack_seconds = time.perf_counter() - t0
        except BaseException as err:  # KeyboardInterrupt too: the receivers must stop waiting
            group.fail(f"the sender failed while sending version {version}: {type(err).__name__}: {err}")
            raise
        stats.seconds = time.perf_counter() - start
        return stats


def wait_for_acknowledgements(group: SyncGroup, r: int, version: int) -> None:
    """Wait until every receiver acknowledged round ``r`` (``version``). One key per
    receiver, and only the receivers still owing one are watched: a receiver that
    acknowledged its last version and then closed the group (at exit) is done, not lost,
    even while another receiver is still loading (:meth:`SyncGroup.wait_until` re-polls
    the acknowledgements after it reads a peer's state)."""
    owing = list(group.receivers)

    def all_acknowledged():
        owing[:] = [p for p in owing if not group.store.check([group.key("round", r, "ack", p)])]
        return True if not owing else None

    group.wait_until(all_acknowledged, owing, f"acknowledgements of version {version}")


class WeightReceiver:
    """A receiving rank (1..N). ``version``: the last version loaded (``loaded``: the one it
    holds at the start, 0 by default; -1 where versions start at 0, as the trainer's do)."""

    def __init__(self, group: SyncGroup, loaded: int = 0):
        if group.rank == 0:
            raise ValueError("rank 0 of a weight-sync group is the sender")
        self.group = group
        self.round = 0
        self.version = loaded

    def receive(self, load=None) -> tuple[int, dict, SyncStats]:
        """Wait for the next version and return ``(version, {name: tensor}, stats)`` once it
        arrived whole, after ``load(version, tensors)`` (if given) returned. Raises
        :class:`TornVersion` (nothing loaded, :attr:`version` unchanged) if it did not."""
        group = self.group
        if group.closed:
            raise WeightSyncError("weight sync: the group is closed")
        self.round += 1
        r, sender = self.round, [0]
        staged: list = []
        version = None
        start = time.perf_counter()
        stats = SyncStats(0)
        try:
            index = 0
            while True:
                bucket_key, commit_key = group.key("round", r, "bucket", index), group.key("round", r, "commit")
                raw = group.wait_until(
                    lambda: ("bucket", group.store.get(bucket_key)) if group.store.check([bucket_key]) else
                    ("commit", group.store.get(commit_key)) if group.store.check([commit_key]) else None,
                    sender, f"the header of bucket {index} of round {r}")
                if raw[0] == "commit":
                    break
                head = parse_header(raw[1], r, index, version)
                if version is None:
                    version = head["version"]
                    if version <= self.version:
                        raise WireFormatError(f"weight sync: version {version} is not newer than the loaded "
                                              f"version {self.version}")
                flat = torch.empty(head["numel"], dtype=head["torch_dtype"], device=group.device)
                t0 = time.perf_counter()
                group.broadcast(flat, sender, f"the transfer of bucket {index} of version {version}")
                stats.transfer_seconds += time.perf_counter() - t0
                if "crc32" in head and crc32(flat) != head["crc32"]:
                    raise WireFormatError(f"weight sync: bucket {index} of version {version} fails its CRC-32")
                staged.append((head, flat))
                index += 1
            record = check_commit(raw[1], r, version, staged)
            version = record["version"] if version is None else version
            tensors = dict(pair for head, flat in staged for pair in unpack(flat, head))
        except (PeerLost, WireFormatError) as err:
            group.fail(f"receiver rank {group.rank} refused version {version}: {err}")
            raise TornVersion(version, self.version, str(err)) from err
        except BaseException as err:
            group.fail(f"receiver rank {group.rank} failed in version {version}: {type(err).__name__}: {err}")
            raise
        if load is not None:
            try:
                load(version, tensors)
            except BaseException as err:  # the sender must not wait for this receiver's acknowledgement
                group.fail(f"receiver rank {group.rank} could not load version {version}: {type(err).__name__}: {err}")
                raise
        self.version = version
        group.store.set(group.key("round", r, "ack", group.rank), b"1")
        stats.version, stats.buckets, stats.tensors = version, len(staged), len(tensors)
        stats.bytes = sum(flat.numel() * flat.element_size() for _, flat in staged)
        stats.seconds = time.perf_counter() - start
        return version, tensors, stats
