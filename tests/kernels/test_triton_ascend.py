"""The ``triton`` backend (portarl's Triton kernels on an Ascend NPU through triton-ascend)
says when it cannot run, and the triton-ascend compile check (``make check-triton-ascend``,
tests/kernels/ascend_worker.py) tells a variant that got through the linalg stage from one
that failed. The compile check itself runs in its own environment (triton-ascend replaces
triton); numbers on an NPU are the ``triton-npu`` parity target (marked ``npu``)."""

from __future__ import annotations

import types

import pytest
import torch

import npu_standin  # tests/: on sys.path (conftest.py)
from portarl.backends import get_backend_by_name
from portarl.backends import triton_ascend
from portarl.backends.npu import torch_npu_api

NPU = types.SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu


def test_triton_names_the_cuda_backend_off_the_npu():
    reason = get_backend_by_name("triton").unavailable_reason(torch.device("cpu"))
    assert "'cuda' backend" in reason


def test_triton_on_an_npu_needs_triton_ascend(monkeypatch):
    monkeypatch.setattr(triton_ascend, "triton_ascend_version", lambda: None)
    with torch_npu_api.use_module(npu_standin, serves_device_type="npu"):
        assert "triton-ascend is not installed" in get_backend_by_name("triton").unavailable_reason(NPU)


def test_triton_on_an_npu_with_triton_ascend_and_torch_npu(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(triton_ascend, "triton_ascend_version", lambda: "3.2.0")
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    with torch_npu_api.use_module(npu_standin, serves_device_type="npu"):
        assert get_backend_by_name("triton").unavailable_reason(NPU) is None
    torch_npu_api.reset()
    monkeypatch.setattr(torch_npu_api, "_load", lambda: None)
    monkeypatch.setattr(torch_npu_api, "_import_error", "torch_npu is not installed")
    assert get_backend_by_name("triton").unavailable_reason(NPU) == "torch_npu is not installed"


def test_compile_check_outcomes():
    import ascend_worker

    cann_missing = RuntimeError("MLIRCompilationError\n[ConvertLinalgRToBinary] encounters error:\n"
                                "ASCEND_HOME_PATH is not set, source <ascend-toolkit>/set_env.sh first")
    assert ascend_worker.outcome(None) == "npubin"
    assert ascend_worker.outcome(cann_missing) == "linalg"
    assert ascend_worker.outcome(RuntimeError("triton-adapter-opt: failed to legalize tt.sort")) == "failed"


def test_training_can_ask_for_the_triton_backend():
    """``--set precision.backend=triton`` (with ``--device npu``) routes every op there; off an
    NPU the run is refused with the reason, before any step."""
    pytest.importorskip("transformers")
    from portarl import ops
    from portarl.backends import BackendUnavailableError
    from portarl.trainer import TrainConfig
    from portarl.trainer.start.setup import forced_backend

    assert TrainConfig.load(None, ["precision.backend=triton"]).precision.backend == "triton"
    with forced_backend("triton"), pytest.raises(BackendUnavailableError, match="'cuda' backend"):
        ops.logprobs(torch.randn(2, 5), torch.tensor([0, 1]))
