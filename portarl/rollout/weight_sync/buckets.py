"""The wire format of a weight version: flat per-dtype buckets, each described by a JSON header.

A version is a sequence of ``(name, tensor)``. The sender groups them by dtype into buckets
of at most ``bucket_bytes`` (a tensor larger than that is a bucket of its own, never split),
copies each bucket's tensors into one contiguous 1-D buffer of that dtype, and describes it
with a header: round, version, bucket index, dtype, element count, names and shapes, and
optionally a CRC-32 of the bytes. Headers and the closing commit record are JSON (never
pickle: nothing received is ever unpickled); the buffers travel as raw tensors.

The receiver checks every header against what it has seen (same round and version,
consecutive indices, a known dtype, element counts that add up, no name twice) and the
commit record against what arrived (bucket count, total bytes), so a version that is cut
short, reordered or mislabelled is refused rather than loaded. The tensors it hands out are
views into the received buffers: no copy beyond the transfer itself.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field

import torch

#: dtypes a version may carry, by the name used in headers.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class WireFormatError(ValueError):
    """A header or commit record that does not describe a well-formed version."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise WireFormatError(f"weight sync cannot carry dtype {dtype}; supported: {', '.join(DTYPES)}") from None


@dataclass
class Bucket:
    """Tensors of one dtype that travel together as one flat buffer."""

    dtype: torch.dtype
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    numel: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor)
        self.numel += tensor.numel()

    def pack(self, device: torch.device | str = "cpu", out: torch.Tensor | None = None,
             copy: bool = False) -> torch.Tensor:
        """One contiguous 1-D buffer on ``device`` holding every tensor's elements in order:
        the tensor itself when the bucket is one contiguous tensor there (no copy) unless
        ``copy`` and it fits ``out``, else a copy into ``out`` (a reusable byte buffer of at
        least :attr:`nbytes`) or a new buffer."""
        fits = out is not None and out.numel() >= self.nbytes
        if (len(self.tensors) == 1 and self.tensors[0].is_contiguous() and self.tensors[0].device == torch.device(device)
                and not (copy and fits)):
            return self.tensors[0].reshape(-1)
        if fits:
            flat = out[:self.nbytes].view(self.dtype)
        else:
            flat = torch.empty(self.numel, dtype=self.dtype, device=device)
        offset = 0
        for tensor in self.tensors:
            n = tensor.numel()
            flat[offset:offset + n].copy_(tensor.reshape(-1))
            offset += n
        return flat


def buckets_of(items, bucket_bytes: int):
    """Yield :class:`Bucket` s from ``(name, tensor)`` pairs, streaming: a bucket is yielded
    as soon as the next tensor of its dtype would overflow it, so the caller never holds
    more than one open bucket per dtype (the gathers of a sharded model stay bounded)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    open_buckets: dict[torch.dtype, Bucket] = {}
    seen: set[str] = set()
    for name, tensor in items:
        if name in seen:
            raise WireFormatError(f"tensor {name!r} appears twice in one weight version")
        seen.add(name)
        dtype_name(tensor.dtype)  # refuse an unsupported dtype before anything is sent
        bucket = open_buckets.get(tensor.dtype)
        if bucket is not None and bucket.numel and bucket.nbytes + tensor.numel() * tensor.element_size() > bucket_bytes:
            yield bucket
            bucket = None
        if bucket is None:
            bucket = open_buckets[tensor.dtype] = Bucket(tensor.dtype)
        bucket.add(name, tensor)
    for bucket in open_buckets.values():
        if bucket.numel:
            yield bucket


def crc32(flat: torch.Tensor) -> int:
    """CRC-32 of a host buffer's bytes (``checksum=True``; about 1.7 GB/s on this CPU)."""
    return zlib.crc32(flat.detach().reshape(-1).view(torch.uint8).numpy())


def header(round_: int, version: int, index: int, bucket: Bucket, checksum: int | None) -> str:
    head = {"round": round_, "version": version, "index": index, "dtype": dtype_name(bucket.dtype),
            "numel": bucket.numel, "names": bucket.names, "shapes": [list(t.shape) for t in bucket.tensors]}
    if checksum is not None:
        head["crc32"] = checksum
    return json.dumps(head)


def commit_record(round_: int, version: int, buckets: int, nbytes: int, tensors: int) -> str:
    return json.dumps({"round": round_, "version": version, "buckets": buckets, "bytes": nbytes, "tensors": tensors})


def _fail(what: str) -> None:
    raise WireFormatError(f"weight sync: {what}")


def parse_header(raw: bytes, round_: int, index: int, version: int | None) -> dict:
    """A bucket header, checked: the round and index this receiver expects, the version of
    the bucket before it (``None`` for the first), element counts that match the shapes."""
    try:
        head = json.loads(raw)
        dtype = DTYPES[head["dtype"]]
        names, shapes, numel = head["names"], head["shapes"], int(head["numel"])
    except (ValueError, KeyError, TypeError) as err:
        raise WireFormatError(f"weight sync: malformed bucket header ({type(err).__name__}: {err})") from None
    if head.get("round") != round_ or head.get("index") != index:
        _fail(f"expected bucket {index} of round {round_}, got bucket {head.get('index')} of round {head.get('round')}")
    if version is not None and head.get("version") != version:
        _fail(f"bucket {index} belongs to version {head.get('version')}, the round's earlier buckets to {version}")
    if len(names) != len(shapes) or not names:
        _fail(f"bucket {index}: {len(names)} names but {len(shapes)} shapes")
    if sum(math.prod(s) for s in shapes) != numel or any(d < 0 for s in shapes for d in s):
        _fail(f"bucket {index}: the shapes hold {sum(math.prod(s) for s in shapes)} elements, the header says {numel}")
    head["torch_dtype"] = dtype
    return head


def unpack(flat: torch.Tensor, head: dict) -> list[tuple[str, torch.Tensor]]:
    """``(name, view)`` for each tensor of a received bucket (views into ``flat``)."""
    out, offset = [], 0
    for name, shape in zip(head["names"], head["shapes"]):
        n = math.prod(shape)
        out.append((name, flat[offset:offset + n].view(shape)))
        offset += n
    return out


def check_commit(raw: bytes, round_: int, version: int | None, staged: list[tuple[dict, torch.Tensor]]) -> dict:
    """The commit record, checked against the buckets staged for the round."""
    try:
        record = json.loads(raw)
        buckets, nbytes, tensors = int(record["buckets"]), int(record["bytes"]), int(record["tensors"])
    except (ValueError, KeyError, TypeError) as err:
        raise WireFormatError(f"weight sync: malformed commit record ({type(err).__name__}: {err})") from None
    if record.get("round") != round_ or (version is not None and record.get("version") != version):
        _fail(f"commit of round {record.get('round')} version {record.get('version')} closes round {round_} "
              f"version {version}")
    got_bytes = sum(flat.numel() * flat.element_size() for _, flat in staged)
    got_tensors = sum(len(head["names"]) for head, _ in staged)
    if (buckets, nbytes, tensors) != (len(staged), got_bytes, got_tensors):
        _fail(f"version {record.get('version')} is incomplete: the sender committed {buckets} buckets, {tensors} "
              f"tensors, {nbytes} bytes; {len(staged)} buckets, {got_tensors} tensors, {got_bytes} bytes arrived")
    names = [n for head, _ in staged for n in head["names"]]
    if len(set(names)) != len(names):
        _fail(f"version {record.get('version')} names a tensor twice")
    return record
