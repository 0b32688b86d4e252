"""Backends: host-side dispatch of portarl's ops, one interface (:class:`Backend`).

- ``reference``: pure PyTorch, row-chunked, fp32 accumulation; any device; the fallback.
- ``cuda``: Triton kernels (:mod:`portarl.kernels`); CUDA tensors, or CPU tensors under
  ``TRITON_INTERPRET=1``.
- ``npu``: torch_npu operators, every call in :mod:`portarl.backends.npu.torch_npu_api`.
- ``triton``: the ``cuda`` backend's Triton kernels on an Ascend NPU through triton-ascend
  (:mod:`portarl.backends.triton_ascend`).

Beside them, what decides how the numerics run on a device: :mod:`.device` (naming and
resolving a device), :mod:`.precision_switches` (matmul precision and the NPU's switches
that change results), :mod:`.emulation` (an Ascend stack's numerics emulated on another
device) and :mod:`.envinfo` (the versions and switches a report records).
"""

from __future__ import annotations

import torch

from portarl.backends.base import Backend, BackendUnavailableError
from portarl.backends.dispatch import (
    BACKEND_ENV,
    choose_backend,
    clear_fallbacks,
    fallback_counts,
    fallbacks,
)
from portarl.backends.registry import BACKEND_NAMES, get_backend_by_name


def get_backend(device_or_name: str | torch.device | Backend = "auto") -> Backend:
    """The backend object for a backend name or for a device.

    ``get_backend("cuda")`` names a backend; ``get_backend("auto")``, ``get_backend("cpu")``
    or ``get_backend(torch.device("cuda:0"))`` resolve the device (see
    :func:`portarl.resolve_device`) and return the backend ops would use there, honouring
    ``PORTARL_BACKEND`` and recording a fallback when the device's own backend cannot run.
    """
    if isinstance(device_or_name, Backend):
        return device_or_name
    if isinstance(device_or_name, str) and device_or_name in BACKEND_NAMES:
        # "cuda" and "npu" name both a backend and a device: the backend is what is asked for.
        return get_backend_by_name(device_or_name)
    from portarl.backends.device import resolve_device

    return choose_backend("get_backend", resolve_device(device_or_name))


__all__ = [
    "BACKEND_ENV",
    "BACKEND_NAMES",
    "Backend",
    "BackendUnavailableError",
    "choose_backend",
    "clear_fallbacks",
    "fallback_counts",
    "fallbacks",
    "get_backend",
    "get_backend_by_name",
]
