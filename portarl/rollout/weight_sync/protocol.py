"""Sending and receiving weight versions over a :class:`~portarl.rollout.weight_sync.group.SyncGroup`.

One version is one *round* (numbered from 1 on both sides, in step):

1. for each bucket (:mod:`~portarl.rollout.weight_sync.buckets`): the sender packs it, puts
   its JSON header in the store under ``round/<r>/bucket/<i>``, and broadcasts the buffer;
   each receiver waits for the header (watching the sender's liveness), checks it, and
   takes part in the broadcast into a fresh staging buffer;
2. the sender puts the commit record (version, bucket count, bytes, tensor count) under
   ``round/<r>/commit`` once the last bucket's broadcast has started (a receiver reads it
   only after its own share of every broadcast completed, so it never vouches for data
   still on the wire);
3. each receiver checks the commit against what it staged; only then does it hand the
   version to its ``load`` callable (vLLM's in-place reload, a plain model's
   ``load_state_dict``) and acknowledge (``round/<r>/ack/<rank>``, one key per receiver,
   which the sender may wait for).

A sender that must not block on its receivers (the async trainer, whose worker's receiving
thread competes for the GIL with its generating thread) sends with ``defer=True``: the
call returns once the last bucket is on the wire, from the sender's own buffer, and the
commit record posted; the completion of that transfer and the acknowledgements are waited
for by :meth:`WeightSender.settle`, which the next ``send`` calls first (before it reuses
the buffer or deletes the round's keys).

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
        self._unsettled = None  # a deferred send: (round, version, its last transfer's wait)

    def _buffer(self, slot: int):
        """Two reusable pack buffers of one bucket each: bucket ``i + 1`` is packed into one
        while bucket ``i`` is sent from the other (no fresh allocation per bucket)."""
        if self._buffers[slot] is None or self._buffers[slot].numel() < self.bucket_bytes:
            self._buffers[slot] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.group.device)
        return self._buffers[slot]

    def send(self, version: int, items, *, defer: bool = False, on_bucket=None) -> SyncStats:
        """Publish ``items`` (``(name, tensor)`` pairs, consumed once, in order) as
        ``version``; return once every receiver loaded it, or with ``defer`` once the last
        bucket is on the wire and the commit record posted (:meth:`settle` waits for the
        rest; the next send calls it first). ``on_bucket(i, names)`` is called before
        bucket ``i`` is broadcast (fault injection in tests)."""
        if self.group.closed:
            raise WeightSyncError("weight sync: the group is closed")
        if self.version is not None and version <= self.version:
            raise ValueError(f"weight versions must increase: {version} after {self.version}")
        self.settle()
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
            owned = False  # the last bucket was packed into a buffer of the sender's own
            for index, (bucket, last) in enumerate(_with_last(buckets_of(items, self.bucket_bytes))):
                t0 = time.perf_counter()
                buffer = self._buffer(index % 2)
                # deferred: the last bucket stays on the wire after send returns, so it must
                # not be the caller's tensor (the trainer's optimizer updates it in place)
                flat = bucket.pack(group.device, out=buffer, copy=defer and last)
                owned = flat.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
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
            if pending is not None and not (defer and owned):
                t0 = time.perf_counter()
                pending()
                pending = None
                stats.transfer_seconds += time.perf_counter() - t0
            if not stats.buckets:
                raise ValueError(f"weight version {version} has no tensors")
            for index in range(stats.buckets, self._last_buckets if r > 1 else 0):
                group.store.delete_key(group.key("round", r - 1, "bucket", index))
            self._last_buckets = stats.buckets
            group.store.set(group.key("round", r, "commit"),
                            commit_record(r, version, stats.buckets, stats.bytes, stats.tensors))
            self.version = version
            if defer:
                self._unsettled = (r, version, pending)
            else:
                t0 = time.perf_counter()
                wait_for_acknowledgements(group, r, version)
                stats.ack_seconds = time.perf_counter() - t0
        except BaseException as err:  # KeyboardInterrupt too: the receivers must stop waiting
            group.fail(f"the sender failed while sending version {version}: {type(err).__name__}: {err}")
            raise
        stats.seconds = time.perf_counter() - start
        return stats

    @property
    def unsettled(self) -> int | None:
        """The version of a deferred send not yet settled (``None``: none)."""
        return self._unsettled[1] if self._unsettled is not None else None

    def settle(self) -> float:
        """Wait until the deferred send's last transfer completed and every receiver
        acknowledged its version (no-op without one); returns the seconds waited. A receiver
        that refused the version, failed or died raises here, as it would have in ``send``."""
        if self._unsettled is None:
            return 0.0
        r, version, pending = self._unsettled
        self._unsettled = None
        t0 = time.perf_counter()
        try:
            if pending is not None:
                pending()
            wait_for_acknowledgements(self.group, r, version)
        except BaseException as err:
            self.group.fail(f"the sender failed while settling version {version}: {type(err).__name__}: {err}")
            raise
        return time.perf_counter() - t0


def _next_record(store, bucket_key: str, commit_key: str):
    """``("bucket", header)``, ``("commit", record)`` or ``None`` (neither posted yet). The
    commit is looked for first: the sender posts every header before the commit, so once
    the commit is seen a header that is not there will not come. (Looking for the header
    first could miss it, posted right after, and then see the commit that followed it: a
    deferred send posts the commit without waiting for the receivers.)"""
    committed = store.check([commit_key])
    if store.check([bucket_key]):
        return "bucket", store.get(bucket_key)
    return ("commit", store.get(commit_key)) if committed else None


def _with_last(iterable):
    """``(item, is_last)`` pairs, looking one item ahead (the buckets are streamed)."""
    it = iter(iterable)
    try:
        item = next(it)
    except StopIteration:
        return
    for following in it:
        yield item, False
        item = following
    yield item, True


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
                raw = group.wait_until(lambda: _next_record(group.store, bucket_key, commit_key), sender,
                                       f"the header of bucket {index} of round {r}")
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
