"""The NCCL / HCCL data plane of the weight-sync group (``device_comm.VllmDeviceComm``) run
over a STAND-IN of vLLM's ``StatelessProcessGroup`` and of ``PyNcclCommunicator`` /
vllm-ascend's ``PyHcclCommunicator`` on the CPU. The stand-in implements their documented
behaviour (vllm/distributed/device_communicators/pynccl.py,
vllm_ascend/distributed/device_communicators/pyhccl.py): a ``(group, device)``
constructor, ``disabled`` when the world has one rank or the library does not load (and
then ``broadcast`` returns having sent nothing), ``broadcast`` refusing a tensor on another
device. This checks portarl's logic around them; it is not a hardware test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from portarl.rollout.weight_sync.device_comm import VllmDeviceComm

sys.path.insert(0, str(Path(__file__).parent))
import standin_vllm  # noqa: E402


@pytest.fixture
def stand_in(monkeypatch):
    from portarl.rollout.weight_sync import device_comm

    for name, module in standin_vllm.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(device_comm, "DeviceStreams", standin_vllm.StandInStreams)
    monkeypatch.setattr(standin_vllm.StandInCommunicator, "library_loads", True)
    return standin_vllm.StandInCommunicator


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
    assert src == 0 and stream is comm.streams.stream and stream.waited_for_current == 1  # ordered after the pack
    assert sent.dtype == torch.uint8 and sent.data_ptr() == flat.data_ptr()  # no copy, every dtype alike
    assert torch.equal(sent.view(dtype), flat)
    assert done() is True
    comm.abort()
    assert comm.comm.stopped


def test_no_device_is_refused(stand_in):
    with pytest.raises(ValueError, match="needs the device"):
        VllmDeviceComm("nccl", dist.HashStore(), 0, 2, None)
