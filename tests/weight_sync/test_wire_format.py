"""The weight-sync wire format in one process: buckets, headers, commit records, refusals."""

from __future__ import annotations

import json

import pytest
import torch

from portarl.rollout.weight_sync.buckets import (
    WireFormatError,
    buckets_of,
    check_commit,
    commit_record,
    header,
    parse_header,
    unpack,
)


def _items():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(100, generator=g)),                           # fp32, 400 B
        ("b", torch.randn(10, 10, generator=g).to(torch.bfloat16)),     # bf16, 200 B
        ("c", torch.randn(50, generator=g)),                            # fp32, 200 B
        ("d", torch.randn(300, generator=g)),                           # fp32, 1200 B: over the cap alone
        ("e", torch.randn(4, 8, generator=g).to(torch.float16).t()),    # fp16, non-contiguous
        ("f", torch.tensor(3.0)),                                       # fp32 scalar
    ]


def test_buckets_are_per_dtype_capped_and_in_order():
    buckets = list(buckets_of(iter(_items()), bucket_bytes=640))
    layout = [(b.dtype, b.names) for b in buckets]
    assert layout == [
        (torch.float32, ["a", "c"]),     # 600 B; adding d would pass 640
        (torch.float32, ["d"]),          # larger than the cap: a bucket of its own, never split
        (torch.float32, ["f"]),          # the open buckets, flushed at the end
        (torch.bfloat16, ["b"]),
        (torch.float16, ["e"]),
    ]


def test_pack_then_unpack_is_bitwise():
    items = dict(_items())
    for bucket in buckets_of(iter(_items()), bucket_bytes=640):
        flat = bucket.pack()
        head = parse_header(header(1, 7, 0, bucket, None).encode(), 1, 0, None)
        for name, view in unpack(flat, head):
            want = items[name]
            assert view.dtype == want.dtype and view.shape == want.shape
            assert torch.equal(view.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8))


def test_a_name_twice_or_an_unsupported_dtype_is_refused_before_sending():
    with pytest.raises(WireFormatError, match="appears twice"):
        list(buckets_of(iter([("x", torch.zeros(2)), ("x", torch.ones(2))]), 1024))
    with pytest.raises(WireFormatError, match="complex64"):
        list(buckets_of(iter([("z", torch.zeros(2, dtype=torch.complex64))]), 1024))
    with pytest.raises(ValueError, match="positive"):
        list(buckets_of(iter([]), 0))


def _head(**change):
    bucket = next(buckets_of(iter([("w", torch.zeros(2, 3))]), 1024))
    head = json.loads(header(2, 5, 1, bucket, None))
    head.update(change)
    return json.dumps(head).encode()


@pytest.mark.parametrize("change, expect", [
    ({"round": 3}, "expected bucket 1 of round 2"),
    ({"index": 2}, "expected bucket 1 of round 2"),
    ({"version": 6}, "belongs to version 6"),
    ({"numel": 7}, "hold 6 elements, the header says 7"),
    ({"shapes": [[2, 3], [1]]}, "1 names but 2 shapes"),
    ({"dtype": "float8"}, "malformed bucket header"),
])
def test_a_header_that_does_not_fit_is_refused(change, expect):
    with pytest.raises(WireFormatError, match=expect):
        parse_header(_head(**change), 2, 1, 5)
    parse_header(_head(), 2, 1, 5)  # the unchanged header passes


def test_a_commit_that_does_not_match_the_staged_buckets_is_refused():
    staged = []
    for i, bucket in enumerate(buckets_of(iter(_items()), bucket_bytes=640)):
        staged.append((parse_header(header(1, 3, i, bucket, None).encode(), 1, i, None), bucket.pack()))
    nbytes = sum(f.numel() * f.element_size() for _, f in staged)
    good = commit_record(1, 3, len(staged), nbytes, 6).encode()
    assert check_commit(good, 1, 3, staged)["version"] == 3
    with pytest.raises(WireFormatError, match="incomplete"):
        check_commit(good, 1, 3, staged[:-1])  # the last bucket never arrived
    with pytest.raises(WireFormatError, match="incomplete"):
        check_commit(commit_record(1, 3, len(staged), nbytes + 4, 6).encode(), 1, 3, staged)
    with pytest.raises(WireFormatError, match="closes round 1 version 4"):
        check_commit(good, 1, 4, staged)
