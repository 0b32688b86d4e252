"""``optim.implementation=fused`` on an Ascend NPU: allowed where torch_npu registered its
``_fused_adamw_`` kernel for the NPU, refused with the reason otherwise. The torch_npu
stand-in answers the import; the dispatcher's answer is set per test (NOT hardware: that
the kernel computes AdamW is checked on a device, docs/hardware-ci.md)."""

from __future__ import annotations

import types

import pytest
import torch

import npu_standin
from portarl.backends.npu import torch_npu_api
from portarl.trainer.phases.optimizer import resolve_implementation

pytestmark = pytest.mark.npu_standin

NPU = types.SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu


@pytest.fixture
def npu_host(monkeypatch):
    kernels = {}
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "npu")
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key",
                        lambda op, key: kernels.get((op, key), False))
    with torch_npu_api.use_module(npu_standin, serves_device_type="npu"):
        yield kernels


def test_fused_is_allowed_where_torch_npu_registers_the_kernel(npu_host):
    npu_host["aten::_fused_adamw_", "PrivateUse1"] = True
    assert resolve_implementation("fused", NPU) == "fused"
    assert resolve_implementation("auto", NPU) == "foreach"  # auto waits for a measurement on hardware


def test_fused_is_refused_with_the_reason_where_it_does_not(npu_host):
    with pytest.raises(ValueError, match=r"optim.implementation=fused: torch_npu standin registers no "
                                         r"_fused_adamw_ kernel for the NPU .*; use optim.implementation=auto or foreach"):
        resolve_implementation("fused", NPU)
