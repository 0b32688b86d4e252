"""A stand-in for vLLM with vllm-ascend v0.23 on an NPU, for the vllm engine's start-up
logic on a CPU machine (tests/test_vllm_ascend_standin.py). NOT vLLM: nothing generates.

What it reproduces, from vllm-ascend v0.23.0's wheel:
- starting the engine changes process-wide switches: ``torch.npu.config.allow_internal_format
  = True`` (``worker/model_runner_v1.py``, at import) and, with batch invariance,
  ``torch.use_deterministic_algorithms(True, warn_only=True)`` (``batch_invariant.py``);
- its ``NPUWorker`` has no ``reload_weights``; ``get_model()``, ``model_config``, ``device``;
- vLLM's post-load processing, ``vllm.model_executor.model_loader.utils.process_weights_after_loading``
  (recorded in :data:`post_load_calls`);
- dense layers carry ``quant_method`` = ``AscendUnquantizedLinearMethod``; a fused-MoE layer
  ``AscendUnquantizedFusedMoEMethod`` (vllm-ascend transposes its experts after loading);
- a vision-language model (``model_kind`` "vision"): vLLM's ``Qwen2_5_VLForConditionalGeneration``
  reduced to its module tree's top, a ``visual`` tower and a ``language_model``, whose
  ``load_weights`` maps the checkpoint's names as vLLM's ``hf_to_vllm_mapper`` does
  (``model_executor/models/qwen2_5_vl.py``); "vision-quantised": one tower layer quantised
  (``AscendLinearMethod``, the wrapper vllm-ascend's quantisation config gives linear
  layers, e.g. W8A8); the engine's ``reset_encoder_cache`` and the logits-processor base
  classes (``vllm.v1.sample.logits_processor``) a vision engine uses.
"""

from __future__ import annotations

import functools
import sys
import types

import torch

post_load_calls: list = []
#: What the next engine's model holds: "dense", "moe", "vision" or "vision-quantised".
model_kind = {"value": "dense"}


def _method(name: str):
    return type(name, (), {})()


class FusedMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(2, 4, 3), requires_grad=False)
        self.quant_method = _method("AscendUnquantizedFusedMoEMethod")


class TinyModel(torch.nn.Module):
    """vLLM-style: ``load_weights`` copies checkpoint tensors into parameters by name."""

    def __init__(self, moe: bool):
        super().__init__()
        self.proj = torch.nn.Linear(3, 2, bias=False)
        self.proj.quant_method = _method("AscendUnquantizedLinearMethod")
        if moe:
            self.experts = FusedMoE()

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


class QKVParallelLinear(torch.nn.Linear):
    """A vision tower's fused attention input projection (vLLM's layer type)."""

    def __init__(self, method: str):
        super().__init__(2, 2, bias=False)
        self.quant_method = _method(method)


class VisionLanguageModel(torch.nn.Module):
    """vLLM's Qwen2.5-VL model, reduced: ``visual`` (a block's ``attn.qkv``, the ``merger``)
    and ``language_model``. ``load_weights`` renames each checkpoint tensor by vLLM's
    prefixes (first match wins, as ``WeightsMapper`` does), refuses a name it cannot place
    (vLLM raises a KeyError for an unknown parameter) and keeps a copy of what it loaded in
    :attr:`held` (vLLM's fused parameters are not modelled); :attr:`loads`: the names of each call."""

    MAPPING = (("model.language_model.", "language_model.model."), ("model.visual.", "visual."),
               ("lm_head.", "language_model.lm_head."), ("model.", "language_model.model."))

    def __init__(self, quantised_tower: bool):
        super().__init__()
        self.visual = torch.nn.Module()
        block = torch.nn.Module()
        block.attn = torch.nn.Module()
        block.attn.qkv = QKVParallelLinear("AscendLinearMethod" if quantised_tower else "AscendUnquantizedLinearMethod")
        self.visual.blocks = torch.nn.ModuleList([block])
        self.visual.merger = torch.nn.Linear(2, 2, bias=False)
        self.visual.merger.quant_method = _method("AscendUnquantizedLinearMethod")
        self.language_model = TinyModel(moe=False)
        self.held: dict[str, torch.Tensor] = {}
        self.loads: list[set[str]] = []

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            prefix, new = next(((p, n) for p, n in self.MAPPING if name.startswith(p)), (None, None))
            if prefix is None:
                raise KeyError(name)
            self.held[new + name[len(prefix):]] = tensor.detach().clone()
            loaded.add(new + name[len(prefix):])
        self.loads.append(loaded)
        return loaded


def _build_model(kind: str) -> torch.nn.Module:
    if kind.startswith("vision"):
        return VisionLanguageModel(quantised_tower=kind == "vision-quantised")
    return TinyModel(kind == "moe")


class NPUWorker:
    def __init__(self, model):
        self._model, self.model_config, self.device = model, "model-config", torch.device("cpu")

    def get_model(self):
        return self._model


class LLM:
    def __init__(self, **kwargs):
        from portarl.backends.npu import torch_npu_api

        self.kwargs = kwargs
        torch_npu_api._module._C._npu_setOption({"ALLOW_INTERNAL_FORMAT": "enable"})
        torch.use_deterministic_algorithms(True, warn_only=True)
        self.worker = NPUWorker(_build_model(model_kind["value"]))
        self.prefix_resets = self.encoder_resets = 0
        self.llm_engine = types.SimpleNamespace(reset_encoder_cache=self._reset_encoder_cache)

    def _reset_encoder_cache(self):
        self.encoder_resets += 1

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        fn = getattr(self.worker, method) if isinstance(method, str) else functools.partial(method, self.worker)
        return [fn(*args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.prefix_resets += 1


def _process_weights_after_loading(model, model_config, target_device):
    post_load_calls.append((model, model_config, target_device))


def install(monkeypatch) -> None:
    """Put the stand-in in ``sys.modules`` as ``vllm`` (undone by ``monkeypatch``)."""
    post_load_calls.clear()
    vllm = types.ModuleType("vllm")
    vllm.LLM = LLM
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: False)
    utils = types.ModuleType("vllm.model_executor.model_loader.utils")
    utils.process_weights_after_loading = _process_weights_after_loading
    loader = types.ModuleType("vllm.model_executor.model_loader")
    loader.utils = utils
    executor = types.ModuleType("vllm.model_executor")
    executor.model_loader = loader
    logits = types.ModuleType("vllm.v1.sample.logits_processor")
    logits.LogitsProcessor = type("LogitsProcessor", (), {})
    logits.BatchUpdate = type("BatchUpdate", (), {})
    logits.MoveDirectionality = types.SimpleNamespace(SWAP="swap", UNIDIRECTIONAL="unidirectional")
    for name, module in (("vllm", vllm), ("vllm.platforms", platforms), ("vllm.model_executor", executor),
                         ("vllm.model_executor.model_loader", loader),
                         ("vllm.model_executor.model_loader.utils", utils), ("vllm.v1", types.ModuleType("vllm.v1")),
                         ("vllm.v1.sample", types.ModuleType("vllm.v1.sample")),
                         ("vllm.v1.sample.logits_processor", logits)):
        monkeypatch.setitem(sys.modules, name, module)
