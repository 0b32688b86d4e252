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
  (``vllm/distributed/weight_transfer/nccl_common.py``). Chosen by ``rollout.sync_comm``
  (:func:`portarl.trainer.asynchronous.sync.choose_comm`). Written against that API and
  **not run here** (no GPU or NPU on this machine): the first hardware run must check it.
  Its logic runs here over a stand-in communicator (``tests/weight_sync/standin_vllm.py``).
  Note that the stateless group exchanges NCCL's unique id with ``broadcast_obj``, which
  pickles it through the store (``vllm/distributed/utils.py``); nothing portarl reads is
  pickled.
"""

from __future__ import annotations

import contextlib
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
    that built one ends without interpreter finalisation (:mod:`portarl.runtime.exit_path`)."""
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


class DeviceStreams:
    """The stream a device communicator broadcasts on, and how its completion is seen.

    A bucket is packed (or, on a receiver, allocated) on the calling thread's current
    stream; the broadcast runs on a stream of the communicator's own, made to wait for the
    current one first (:meth:`enter`), so the next bucket is packed while this one is on the
    wire, as vLLM's packed broadcast does (``vllm/distributed/weight_transfer/packed_tensor.py``).
    One stream for the communicator's life: the caching allocator keys cached blocks by
    stream, and a fresh stream per call would strand them. The buffer is marked as used on
    that stream (``record_stream``), and its completion (:meth:`completion`) is an event
    recorded after the broadcast, polled by the waiting rank (which keeps watching its peers
    meanwhile): once it has fired, the bytes are in place for any stream."""

    def __init__(self, device: torch.device):
        self.module = getattr(torch, device.type)  # torch.cuda / torch.npu
        self.stream = self.module.Stream(device=device)

    def enter(self, flat: torch.Tensor):
        """The stream to broadcast ``flat`` on, ordered after the work that filled it."""
        self.stream.wait_stream(self.module.current_stream(flat.device))
        flat.record_stream(self.stream)
        return self.stream

    def completion(self):
        """A poll that says whether everything enqueued on the stream so far has finished."""
        event = self.module.Event()
        event.record(self.stream)
        return event.query


class VllmDeviceComm:
    """NCCL / HCCL through vLLM's communicator (untested on hardware: see the module
    docstring), on a stream of its own (:class:`DeviceStreams`)."""

    def __init__(self, kind: str, store, rank: int, world_size: int, device):
        from vllm.distributed.utils import StatelessProcessGroup

        _BUILT.append(True)
        if device is None:
            raise ValueError(f"weight-sync comm={kind!r} needs the device its buffers live on")
        device = torch.device(device)
        if device.index is None and device.type != "cpu":  # (the CPU: a stand-in's, in tests)
            # the communicator compares each tensor's device with its own: "cuda" never equals "cuda:0"
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        self.device = device
        group = StatelessProcessGroup(rank=rank, world_size=world_size,
                                      store=dist.PrefixStore(f"portarl/weight-sync/{kind}", store))
        with _unpinned(kind):
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
        self.streams = DeviceStreams(self.device)

    def broadcast(self, flat: torch.Tensor):
        if flat.device != self.device:
            raise ValueError(f"weight sync: a bucket on {flat.device} cannot go through the communicator of "
                             f"{self.device}")
        self.comm.broadcast(flat.view(torch.uint8), src=0, stream=self.streams.enter(flat))
        return self.streams.completion()  # polled: the waiting rank keeps watching its peers meanwhile

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


def _unpinned(kind: str):
    """vLLM's own weight-transfer engine creates a communicator shared with other processes
    under ``unpinned_nccl_env()`` (the NCCL settings vLLM pins for its engine lifted:
    ``vllm/distributed/weight_transfer/nccl_common.py``); the same here where that vLLM has it."""
    if kind == "nccl":
        try:
            from vllm.utils.nccl import unpinned_nccl_env

            return unpinned_nccl_env()
        except ImportError:  # an older vLLM: it pins nothing
            pass
    return contextlib.nullcontext()


def vllm_device_comm(kind: str, store, rank: int, world_size: int, device) -> VllmDeviceComm:
    return VllmDeviceComm(kind, store, rank, world_size, device)
