"""The data plane of a weight-sync group: who moves the bucket buffers.

Each communicator offers ``broadcast(flat) -> done`` (start broadcasting ``flat`` from rank
0, return a callable that says whether it finished, raising if it failed), ``device`` (where
buffers must live) and ``abort()``. Buffers travel as their bytes (a ``uint8`` view), so a
communicator never needs to support a dtype: bf16, fp16, fp32 and int buffers are the same
to it.

- :class:`GlooComm` (CPU; tested here): a ``ProcessGroupGloo`` built directly on the
  group's store, outside ``torch.distributed``'s global state, so it coexists with the
  trainer's own process group under torchrun and needs no ``init_process_group``.
- :func:`vllm_device_comm` (CUDA / Ascend): vLLM's ``StatelessProcessGroup`` over the same
  store with ``PyNcclCommunicator`` (``vllm/distributed/device_communicators/pynccl.py``) or
  vllm-ascend's ``PyHcclCommunicator``
  (``vllm_ascend/distributed/device_communicators/pyhccl.py``), both
  ``(group, device)`` constructors with ``broadcast(tensor, src, stream=None)``, as vLLM's
  own NCCL weight-transfer engine uses them
  (``vllm/distributed/weight_transfer/nccl_common.py``). Written against that API and
  **not run here** (no GPU or NPU on this machine): the first hardware run must check it.
  Its logic runs here over a stand-in communicator (``tests/weight_sync/test_device_comm_standin.py``).
  Note that the stateless group exchanges NCCL's unique id with ``broadcast_obj``, which
  pickles it through the store (``vllm/distributed/utils.py``); nothing portarl reads is
  pickled.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


#: Communicators cut in the middle of a collective. Never destroyed: destroying a Gloo group
#: waits for its pending transfer, which a dead peer never finishes, until the group's
#: timeout (measured: the process hung in the destructor after the sender was killed).
_ABANDONED: list = []


_BUILT: list = []


def groups_built() -> int:
    """How many communicators this process built: their threads outlive them, so a command
    that built one ends without interpreter finalisation (:mod:`portarl.exit_path`)."""
    return len(_BUILT)


class GlooComm:
    device = torch.device("cpu")

    def __init__(self, store, rank: int, world_size: int, timeout_s: float):
        _BUILT.append(True)
        # joining blocks until every rank has joined (bounded by timeout_s)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("portarl/weight-sync/gloo", store), rank, world_size,
                                        timedelta(seconds=timeout_s))
        self.options = dist.BroadcastOptions()
        self.options.rootRank = 0

    def broadcast(self, flat: torch.Tensor):
        work = self.pg.broadcast([flat.view(torch.uint8)], self.options)
        self.pending = work  # alive until the next transfer (or forever, if this one is cut)

        def done() -> bool:
            if not work.is_completed():
                return False
            work.wait()  # raises the transfer's error, if any
            return True

        return done

    def abort(self) -> None:
        _ABANDONED.append(self)
        try:
            self.pg.abort()
        except Exception:  # already aborted or shut down
            pass


class VllmDeviceComm:
    """NCCL / HCCL through vLLM's communicator (untested here: see the module docstring)."""

    def __init__(self, kind: str, store, rank: int, world_size: int, device):
        from vllm.distributed.utils import StatelessProcessGroup

        _BUILT.append(True)
        if device is None:
            raise ValueError(f"weight-sync comm={kind!r} needs the device its buffers live on")
        self.device = torch.device(device)
        self.module = getattr(torch, self.device.type)  # torch.cuda / torch.npu: streams and events
        group = StatelessProcessGroup(rank=rank, world_size=world_size,
                                      store=dist.PrefixStore(f"portarl/weight-sync/{kind}", store))
        if kind == "nccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

            self.comm = PyNcclCommunicator(group, device=self.device)
        else:
            from vllm_ascend.distributed.device_communicators.pyhccl import PyHcclCommunicator

            self.comm = PyHcclCommunicator(group, device=self.device)
        if getattr(self.comm, "disabled", False):
            # Both communicators switch themselves off when their library does not load (or
            # VLLM_DISABLE_PYNCCL is set) and then return from broadcast() having sent nothing:
            # every receiver would load its uninitialised buffers as the new weights.
            library = "NCCL" if kind == "nccl" else "HCCL"
            raise RuntimeError(f"weight-sync comm={kind!r}: vLLM's {type(self.comm).__name__} is disabled on "
                               f"{self.device} (the {library} library did not load, or VLLM_DISABLE_PYNCCL is set), "
                               "so its broadcast would send nothing; fix the library, or sync over comm='gloo'")

    def broadcast(self, flat: torch.Tensor):
        stream = self.module.current_stream()
        self.comm.broadcast(flat.view(torch.uint8), src=0, stream=stream)
        event = self.module.Event()
        event.record(stream)
        return event.query  # polled: the waiting rank keeps watching its peers meanwhile

    def abort(self) -> None:
        _ABANDONED.append(self)
        for name in ("destroy", "close"):  # PyNccl: destroy() (ncclCommAbort); PyHccl: close()
            stop = getattr(self.comm, name, None)
            if stop is not None:
                try:
                    stop()
                except Exception:
                    pass
                return


def vllm_device_comm(kind: str, store, rank: int, world_size: int, device) -> VllmDeviceComm:
    return VllmDeviceComm(kind, store, rank, world_size, device)
