"""Which backend each collective meets: the process group carries Gloo for the host beside
the accelerator's backend (``init_distributed`` decides it), host-side values are reduced
on the host and device tensors on their device, and nothing is copied to fit a backend.
The 2-rank end-to-end check over a strict stand-in for HCCL is test_strict_hccl.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from portarl.runtime import distributed as pdist

TWO_RANKS_ON_CUDA = pdist.DistContext(rank=0, world_size=2, local_rank=0, backend="nccl")


def test_the_group_has_gloo_for_the_host_beside_the_device_backend():
    assert pdist.process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert pdist.process_group_backend("npu") == "cpu:gloo,npu:hccl"
    assert pdist.process_group_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match="no distributed backend for device type 'tpu'"):
        pdist.process_group_backend("tpu")


@pytest.fixture
def collectives(monkeypatch):
    """dist.all_reduce / all_gather recorded (tensor device, group); the values as one rank's."""
    seen = []

    def all_reduce(tensor, op=None, group=None):
        seen.append((tensor.device.type, group))

    def all_gather(parts, tensor, group=None):
        seen.append((tensor.device.type, group))
        for part in parts:
            part.copy_(tensor)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("a host value was sent to the GPU"))
    return seen


def test_host_flags_and_counts_stay_on_the_host(collectives):
    assert pdist.any_rank(TWO_RANKS_ON_CUDA, True) is True
    assert pdist.first_code(TWO_RANKS_ON_CUDA, 3) == 3
    assert pdist.all_reduce(TWO_RANKS_ON_CUDA, torch.tensor([0.5])).device.type == "cpu"
    assert pdist.all_gather_cat(TWO_RANKS_ON_CUDA, torch.tensor([1.0, 2.0])).tolist() == [1.0, 2.0, 1.0, 2.0]
    assert collectives == [("cpu", None)] * 4


def test_device_tensors_stay_on_their_device(collectives):
    counts = torch.zeros(2, device="meta")  # stands for the token counts on the accelerator
    assert pdist.all_reduce(TWO_RANKS_ON_CUDA, counts).device.type == "meta"
    assert collectives == [("meta", None)]


def test_a_host_group_serves_host_values_where_the_default_group_cannot(collectives):
    host = object()  # the Gloo group init_distributed adds to a caller's device-only group
    ctx = pdist.DistContext(rank=0, world_size=2, local_rank=0, backend="hccl", host_group=host)
    pdist.any_rank(ctx, False)
    pdist.all_reduce(ctx, torch.zeros(1, device="meta"))
    assert collectives == [("cpu", host), ("meta", None)]
