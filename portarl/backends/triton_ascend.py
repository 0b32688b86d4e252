"""The ``triton`` backend: portarl's Triton kernels on an Ascend NPU, through triton-ascend.

The kernels and their host code are the ``cuda`` backend's (:mod:`portarl.kernels`,
:mod:`portarl.backends.cuda`); only where they may run differs. triton-ascend installs as
the ``triton`` package in place of upstream triton and compiles the same ``@triton.jit``
kernels for the NPU (TTIR -> linalg -> npubin, the last stage through CANN's bishengir).
Launches stay within Ascend's 65535 programs per grid (:mod:`portarl.backends.cuda.grid`).

On a CUDA device or under the Triton interpreter the same kernels are the ``cuda``
backend, so ``triton`` names them on the NPU only (a second name for the same numbers on
a GPU would only run every parity case twice). Choose it with ``backend="triton"``,
``PORTARL_BACKEND=triton`` or ``portarl parity --device npu --backends triton``; the
device's own backend on an NPU stays ``npu`` (torch_npu's fused operator).

Checked without an NPU: ``make check-triton-ascend`` takes every kernel variant through
triton-ascend's linalg stage; numbers against float64 need a device (the ``npu``-marked
parity tests, ``portarl parity``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from portarl.backends.cuda import CudaBackend


def triton_ascend_version() -> str | None:
    """The installed triton-ascend's version, or None (absent, or upstream triton installed)."""
    try:
        return importlib.metadata.version("triton-ascend")
    except importlib.metadata.PackageNotFoundError:
        return None


class TritonAscendBackend(CudaBackend):
    name = "triton"

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "npu":
            return (f"the triton backend runs portarl's Triton kernels on Ascend NPUs (triton-ascend); on "
                    f"{device.type} they are the 'cuda' backend")
        if triton_ascend_version() is None or importlib.util.find_spec("triton") is None:
            return ("triton-ascend is not installed: `pip install triton-ascend` (it replaces upstream triton in "
                    "its environment; see docs/hardware-ci.md for the version matrix)")
        from portarl.backends.npu import torch_npu_api

        return torch_npu_api.unavailable_reason()


BACKEND_CLASS = TritonAscendBackend
