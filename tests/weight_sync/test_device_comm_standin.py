"""The NCCL / HCCL data plane of the weight-sync group (``device_comm.VllmDeviceComm``) run
over a STAND-IN of vLLM's ``StatelessProcessGroup`` and of ``PyNcclCommunicator`` /
vllm-ascend's ``PyHcclCommunicator`` on the CPU. The stand-in implements their documented
behaviour (vllm/distributed/device_communicators/pynccl.py,
vllm_ascend/distributed/device_communicators/pyhccl.py): a ``(group, device)``
constructor, ``disabled`` when the world has one rank or the library does not load (and
then ``broadcast`` returns having sent nothing), ``broadcast`` refusing a tensor on another
device. This checks portarl's logic around them; it is not a hardware test."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
import torch.distributed as dist

from portarl.rollout.weight_sync.device_comm import VllmDeviceComm


@dataclasses.dataclass
class StandInGroup:
    rank: int
    world_size: int
    store: object


class StandInCommunicator:
    library_loads = True

    def __init__(self, group, device):
        self.device = torch.device(device)
        self.disabled = group.world_size == 1 or not self.library_loads
        self.calls: list = []
        self.stopped = False

    def broadcast(self, tensor, src, stream=None):
        if self.disabled:
            return  # what both do: nothing sent, nothing said
        assert tensor.device == self.device, "the communicator's device only"
        self.calls.append((tensor, src, stream))

    def destroy(self):  # PyNccl's name; PyHccl's is close()
        self.stopped = True


class StandInHccl(StandInCommunicator):
    destroy = None

    def close(self):
        self.stopped = True


@pytest.fixture
def stand_in(monkeypatch):
    modules = {"vllm": types.ModuleType("vllm"), "vllm.distributed": types.ModuleType("vllm.distributed"),
               "vllm.distributed.utils": types.ModuleType("vllm.distributed.utils"),
               "vllm.distributed.device_communicators": types.ModuleType("vllm.distributed.device_communicators"),
               "vllm.distributed.device_communicators.pynccl": types.ModuleType("pynccl"),
               "vllm_ascend": types.ModuleType("vllm_ascend"),
               "vllm_ascend.distributed": types.ModuleType("vllm_ascend.distributed"),
               "vllm_ascend.distributed.device_communicators": types.ModuleType("device_communicators"),
               "vllm_ascend.distributed.device_communicators.pyhccl": types.ModuleType("pyhccl")}
    modules["vllm.distributed.utils"].StatelessProcessGroup = StandInGroup
    modules["vllm.distributed.device_communicators.pynccl"].PyNcclCommunicator = StandInCommunicator
    modules["vllm_ascend.distributed.device_communicators.pyhccl"].PyHcclCommunicator = StandInHccl
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(StandInCommunicator, "library_loads", True)
    return StandInCommunicator


@pytest.mark.parametrize("kind", ["nccl", "hccl"])
def test_a_disabled_communicator_is_refused_not_used(stand_in, monkeypatch, kind):
    monkeypatch.setattr(stand_in, "library_loads", False)
    with pytest.raises(RuntimeError, match=f"comm='{kind}'.*disabled.*send nothing.*comm='gloo'"):
        VllmDeviceComm(kind, dist.HashStore(), 0, 2, "cpu")


@pytest.mark.parametrize("kind", ["nccl", "hccl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_buckets_go_out_as_their_bytes_from_rank_0(stand_in, kind, dtype):
    comm = VllmDeviceComm(kind, dist.HashStore(), 0, 3, "cpu")
    flat = torch.randn(37, dtype=torch.float32).to(dtype)
    done = comm.broadcast(flat)
    (sent, src, stream), = comm.comm.calls
    assert src == 0 and stream is not None
    assert sent.dtype == torch.uint8 and sent.data_ptr() == flat.data_ptr()  # no copy, every dtype alike
    assert torch.equal(sent.view(dtype), flat)
    assert done() is True
    comm.abort()
    assert comm.comm.stopped


def test_no_device_is_refused(stand_in):
    with pytest.raises(ValueError, match="needs the device"):
        VllmDeviceComm("nccl", dist.HashStore(), 0, 2, None)
