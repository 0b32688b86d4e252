"""What a parity report or benchmark needs to say about the machine it ran on.

Versions of python, torch, triton, CUDA, the NVIDIA driver, torch_npu, CANN and the NPU
driver, and the device name. Every probe is best effort: a missing tool gives None, never
an exception, because a report from a half-configured machine is exactly what one wants
to read. Also the process's numerics switches (:mod:`portarl.backends.precision_switches`:
deterministic algorithms; on an NPU the internal weight format and HF32) and any a rollout
engine changed and portarl set back.
"""

from __future__ import annotations

import contextlib
import platform
import shutil
import subprocess

import torch


def _nvidia_driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )
        return out.stdout.strip().splitlines()[0] or None
    return None


def _triton_version() -> str | None:
    with contextlib.suppress(Exception):
        import triton

        return triton.__version__
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        from portarl.backends.npu import torch_npu_api

        return torch_npu_api.environment().get("npu_name") or "Ascend NPU"
    return f"CPU ({platform.processor() or platform.machine()})"


def environment(device: torch.device) -> dict[str, object]:
    from portarl import __version__
    from portarl.backends.npu import torch_npu_api

    info: dict[str, object] = {
        "portarl": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "nvidia_driver": _nvidia_driver() if device.type == "cuda" else None,
        "device": str(device),
        "device_name": device_name(device),
    }
    if device.type == "cpu":
        import portarl.backends.cuda as cuda_backend

        info["triton_interpreter"] = cuda_backend.CudaBackend().unavailable_reason(device) is None
    npu = torch_npu_api.environment() if device.type == "npu" else {}
    info["torch_npu"] = npu.get("torch_npu")
    info["cann"] = npu.get("cann")
    info["npu_driver"] = npu.get("npu_driver")
    from portarl.backends import precision_switches

    with contextlib.suppress(Exception):
        info["precision_switches"] = precision_switches.read(device.type)
    info["precision_switches_restored"] = precision_switches.restored()
    return info
