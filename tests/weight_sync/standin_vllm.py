"""A STAND-IN for the parts of vLLM (and vllm-ascend) that the NCCL / HCCL weight-sync data
plane uses, so that its logic runs on this CPU. Not a hardware test: no NCCL, no HCCL, no
device stream runs here.

What it implements, as documented in vLLM's source
(``vllm/distributed/device_communicators/pynccl.py``, ``vllm/distributed/utils.py``) and
vllm-ascend's (``vllm_ascend/distributed/device_communicators/pyhccl.py``):

- ``StatelessProcessGroup(rank, world_size, store)``;
- ``PyNcclCommunicator(group, device)`` / ``PyHcclCommunicator(group, device)``: ``disabled``
  when the world has one rank or the library does not load (then ``broadcast`` returns
  having sent nothing); ``broadcast(tensor, src, stream)`` refuses a tensor on another
  device and *enqueues* the transfer on ``stream`` (it returns before the bytes arrived);
  ``destroy()`` (PyNccl) / ``close()`` (PyHccl here) abort it.

The transfer itself goes over a Gloo group built on the same store, and a stand-in stream
(:class:`StandInStreams`, installed in place of ``device_comm.DeviceStreams``) completes
when the Gloo work it holds has. Each call is appended to ``<log>/comm-rank<r>.jsonl`` so
a test can check what went through the communicator.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclasses.dataclass
class StandInGroup:
    rank: int
    world_size: int
    store: object


class StandInStream:
    """A device stream: the transfers enqueued on it, in order."""

    def __init__(self):
        self.pending: list = []
        self.waited_for_current = 0


class StandInStreams:
    """Stands in for :class:`portarl.rollout.weight_sync.device_comm.DeviceStreams`."""

    def __init__(self, device):
        self.stream = StandInStream()

    def enter(self, flat):
        self.stream.waited_for_current += 1
        return self.stream

    def completion(self):
        works = list(self.stream.pending)

        def query() -> bool:
            if not all(w.is_completed() for w in works):
                return False
            for w in works:
                w.wait()  # raises the transfer's error, if any
            return True

        return query


class StandInCommunicator:
    library_loads = True
    log_dir: str | None = None

    def __init__(self, group, device):
        self.device = torch.device(device)
        self.rank = group.rank
        self.disabled = group.world_size == 1 or not self.library_loads
        self.calls: list = []
        self.stopped = False
        if not self.disabled and self.log_dir:  # a test peer: real transfers over Gloo
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("stand-in", group.store), group.rank, group.world_size,
                                            timedelta(seconds=300))

    def broadcast(self, tensor, src, stream=None):
        if self.disabled:
            return  # what both do: nothing sent, nothing said
        assert tensor.device == self.device, "the communicator's device only"
        self.calls.append((tensor, src, stream))
        if getattr(self, "pg", None) is not None:
            options = dist.BroadcastOptions()
            options.rootRank = src
            stream.pending[:] = [self.pg.broadcast([tensor], options)]  # enqueued: returns at once
            with open(os.path.join(self.log_dir, f"comm-rank{self.rank}.jsonl"), "a") as log:
                log.write(json.dumps({"dtype": str(tensor.dtype), "numel": tensor.numel(), "src": src,
                                      "device": str(tensor.device), "ordered": stream.waited_for_current}) + "\n")

    def destroy(self):  # PyNccl's name; PyHccl's is close()
        self.stopped = True
        if getattr(self, "pg", None) is not None:
            try:
                self.pg.abort()
            except Exception:
                pass


class StandInHccl(StandInCommunicator):
    destroy = None

    def close(self):
        StandInCommunicator.destroy(self)


def modules() -> dict[str, types.ModuleType]:
    """The stand-in modules by import name."""
    names = ["vllm", "vllm.distributed", "vllm.distributed.utils", "vllm.distributed.device_communicators",
             "vllm.distributed.device_communicators.pynccl", "vllm_ascend", "vllm_ascend.distributed",
             "vllm_ascend.distributed.device_communicators", "vllm_ascend.distributed.device_communicators.pyhccl"]
    found = {name: types.ModuleType(name) for name in names}
    found["vllm.distributed.utils"].StatelessProcessGroup = StandInGroup
    found["vllm.distributed.device_communicators.pynccl"].PyNcclCommunicator = StandInCommunicator
    found["vllm_ascend.distributed.device_communicators.pyhccl"].PyHcclCommunicator = StandInHccl
    return found


def install(log_dir: str) -> None:
    """Put the stand-in in place in this process (a test peer), logging to ``log_dir``."""
    from portarl.rollout.weight_sync import device_comm

    sys.modules.update(modules())
    StandInCommunicator.log_dir = log_dir
    device_comm.DeviceStreams = StandInStreams
