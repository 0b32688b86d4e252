"""Over NCCL / HCCL a version arrives in the worker's device memory; only the newest staged
version stays there, an older one still waiting for the worker is moved to host memory
(portarl.rollout.weight_sync.inbox). Run over the STAND-IN of vLLM's communicator on the
CPU (tests/weight_sync/standin_vllm.py): the bucket buffers are real, the device is not, so
"moved off the device" is checked as "copied out of the bucket buffers"; not a hardware test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from portarl.rollout.weight_sync.inbox import VersionInbox
from portarl.trainer.asynchronous.sync import CollectiveSync

sys.path.insert(0, str(Path(__file__).parent))
import standin_vllm  # noqa: E402


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    from portarl.rollout.weight_sync import device_comm

    for name, module in standin_vllm.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(device_comm, "DeviceStreams", standin_vllm.StandInStreams)
    monkeypatch.setattr(standin_vllm.StandInCommunicator, "log_dir", str(tmp_path))


def _version(v: int) -> dict:
    g = torch.Generator().manual_seed(v)
    return {"a": torch.randn(64, generator=g), "b": torch.randn(8, 8, generator=g).to(torch.bfloat16),
            "c": torch.randn(32, generator=g)}


def _in_bucket_buffer(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > t.nbytes


@pytest.mark.parametrize("comm", ["gloo", "nccl"], ids=["gloo", "nccl-standin"])
def test_only_the_newest_staged_version_stays_in_the_bucket_buffers(stand_in, comm):
    sender = CollectiveSync(bucket_mb=1, timeout_s=120, workers=1, comm=comm, device=torch.device("cpu"))
    spec = sender.spec(0)
    inbox = VersionInbox(spec["host"], spec["port"], spec["rank"], spec["world_size"], spec["timeout_s"],
                         comm=spec["comm"], device="cpu")
    try:
        for v in (0, 1):
            sender.send(v, iter(_version(v).items()))
            sender.sender.settle()  # acknowledged: staged in the inbox
        staged = dict(inbox._staged)
        assert sorted(staged) == [0, 1]
        assert all(_in_bucket_buffer(staged[1][n]) for n in ("a", "c")), "the newest is a view of its buckets"
        if comm == "gloo":  # host memory already: nothing moved
            assert all(_in_bucket_buffer(staged[0][n]) for n in ("a", "c"))
        else:
            assert not any(_in_bucket_buffer(t) for t in staged[0].values()), "the older one left the device"
        for v in (0, 1):
            want = _version(v)
            assert all(torch.equal(staged[v][n], want[n]) and staged[v][n].dtype == want[n].dtype for n in want)
        taken = inbox.take(1)
        assert inbox._staged == {} and all(torch.equal(taken[n], t) for n, t in _version(1).items())
    finally:
        inbox.close()
        sender.close()
