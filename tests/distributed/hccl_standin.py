"""A CPU stand-in for Ascend's process-group backend, as strict as torch_npu's.

torch_npu registers ``hccl`` for the ``npu`` device type only
(``Backend.register_backend("hccl", ..., devices=["npu"])``), so on a group made with
``init_process_group("hccl")`` a collective on a CPU tensor raises ``No backend type
associated with device type cpu``. :func:`install` reproduces that on a CPU machine:
privateuse1 renamed to ``npu`` (with the hooks torch needs to call it the accelerator,
so ``barrier`` and the object collectives pick the device the way they do on an NPU
host) and ``hccl`` registered for ``npu`` only, running Gloo underneath.

NOT hardware: nothing here says how HCCL behaves on a device; it only makes a backend
refuse what the real one refuses, for tests/distributed/test_strict_hccl.py.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class _Stream:
    """The one stream of the stand-in device (torch.distributed.checkpoint overlaps its host
    copies with a device stream when an accelerator is present)."""

    device_type = "npu"

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class _NpuModule:
    """What torch and portarl ask of ``torch.npu`` before any tensor is made."""

    _stream = _Stream()

    def __init__(self):
        self._device = 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 8

    def current_device(self) -> int:
        return self._device

    def set_device(self, index: int) -> None:
        self._device = int(index)

    def synchronize(self, device=None) -> None:
        pass

    def current_stream(self, device=None) -> _Stream:
        return self._stream

    def stream(self, stream):
        return contextlib.nullcontext()

    def manual_seed_all(self, seed: int) -> None:
        pass

    def _is_in_bad_fork(self) -> bool:
        return False


def _hccl_over_gloo(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def install() -> None:
    """Make ``npu`` a device type and ``hccl`` a backend for it alone (once per process)."""
    if getattr(torch, "npu", None) is not None:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename="npu", backend_module=_NpuModule())
    dist.Backend.register_backend("hccl", _hccl_over_gloo, devices=["npu"])
