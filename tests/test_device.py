"""The device flag: auto order, explicit devices, and errors that say what is missing."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

import portarl
from portarl.backends.npu import torch_npu_api
from portarl.backends.device import DeviceUnavailableError


@pytest.fixture
def fresh_npu_import():
    torch_npu_api.reset()
    yield
    torch_npu_api.reset()


def test_cpu_is_always_available():
    assert portarl.resolve_device("cpu") == torch.device("cpu")
    assert portarl.resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert portarl.resolve_device(" CPU ") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_auto_without_accelerators_is_cpu(fresh_npu_import):
    assert portarl.resolve_device("auto") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_absent_cuda_says_what_is_missing():
    with pytest.raises(DeviceUnavailableError, match="CUDA") as err:
        portarl.resolve_device("cuda")
    assert "install" in str(err.value) or "nvidia-smi" in str(err.value)


def _torch_npu_raises(monkeypatch, error: Exception) -> None:
    """``import torch_npu`` (through importlib, as torch_npu_api imports it) raises ``error``."""
    real = importlib.import_module

    def failing(name, *args):
        if name == "torch_npu":
            raise error
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", failing)


def test_npu_without_torch_npu(monkeypatch, fresh_npu_import):
    _torch_npu_raises(monkeypatch, ModuleNotFoundError("No module named 'torch_npu'", name="torch_npu"))
    with pytest.raises(DeviceUnavailableError, match="torch_npu is not installed") as err:
        portarl.resolve_device("npu")
    assert "pip install" in str(err.value)


def test_npu_with_cann_not_sourced(monkeypatch, fresh_npu_import):
    _torch_npu_raises(monkeypatch, ImportError("libhccl.so: cannot open shared object file: No such file or directory"))
    with pytest.raises(DeviceUnavailableError, match="CANN environment is not sourced") as err:
        portarl.resolve_device("npu:0")
    assert "set_env.sh" in str(err.value)


def test_npu_imported_but_no_device(monkeypatch):
    fake_npu = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "7")
    with torch_npu_api.use_module(types.ModuleType("torch_npu"), serves_device_type="npu"):
        with pytest.raises(DeviceUnavailableError, match="no NPU is visible") as err:
            portarl.resolve_device("npu")
    assert "ASCEND_RT_VISIBLE_DEVICES='7'" in str(err.value) and "npu-smi" in str(err.value)


def test_npu_index_out_of_range(monkeypatch):
    fake_npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2)
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    with torch_npu_api.use_module(types.ModuleType("torch_npu"), serves_device_type="npu"):
        with pytest.raises(DeviceUnavailableError, match="only 2 npu device"):
            portarl.resolve_device("npu:5")


@pytest.mark.parametrize("bad", ["gpu", "tpu", "cuda:x", "", 3, None])
def test_invalid_device_values(bad):
    with pytest.raises(ValueError, match="device"):
        portarl.resolve_device(bad)


def test_get_backend_by_name_and_by_device():
    assert portarl.get_backend("reference").name == "reference"
    assert portarl.get_backend("cuda").name == "cuda"
    assert portarl.get_backend("npu").name == "npu"
    assert portarl.get_backend("cpu").name == "reference"
    assert portarl.get_backend(torch.device("cpu")).name == "reference"
    backend = portarl.get_backend("reference")
    assert portarl.get_backend(backend) is backend


def test_portarl_backend_env_forces_reference(monkeypatch):
    monkeypatch.setenv("PORTARL_BACKEND", "reference")
    assert portarl.get_backend("cpu").name == "reference"


def test_torch_npu_on_a_cuda_torch_is_one_line(monkeypatch, fresh_npu_import):
    """torch_npu refuses a torch built for CUDA with a RuntimeError (two lines, an error code):
    the reason is one line naming the fix, never a traceback."""
    _torch_npu_raises(monkeypatch, RuntimeError(
        "Two accelerators cannot be used at the same time in PyTorch: npu and cuda. You can install the cpu version "
        "of PyTorch to use your npu device, or use the cuda device with 'export TORCH_DEVICE_BACKEND_AUTOLOAD=0'.\n"
        "[ERROR] 2026-11-25-16:00:00 (PID:1, Device:-1, RankID:-1) ERR00007 PTA feature not supported"))
    reason = torch_npu_api.unavailable_reason()
    assert reason is not None and "\n" not in reason
    assert "CPU build" in reason and "portarl[npu]" in reason and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in reason
    with pytest.raises(DeviceUnavailableError, match="torch_npu cannot load into this torch"):
        portarl.resolve_device("npu")


def test_other_runtime_errors_of_torch_npu_are_one_line(monkeypatch, fresh_npu_import):
    _torch_npu_raises(monkeypatch, RuntimeError("Failed to load the backend extension: torch_npu\nmore detail"))
    reason = torch_npu_api.unavailable_reason()
    assert reason is not None and "\n" not in reason and "Failed to load the backend extension" in reason
