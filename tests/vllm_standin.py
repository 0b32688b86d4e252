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
  ``AscendUnquantizedFusedMoEMethod`` (vllm-ascend transposes its experts after loading).
"""

from __future__ import annotations

import functools
import sys
import types

import torch

post_load_calls: list = []
#: What the next engine's model holds: "dense" or "moe".
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
        self.worker = NPUWorker(TinyModel(model_kind["value"] == "moe"))
        self.prefix_resets = 0

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
    for name, module in (("vllm", vllm), ("vllm.platforms", platforms), ("vllm.model_executor", executor),
                         ("vllm.model_executor.model_loader", loader),
                         ("vllm.model_executor.model_loader.utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)
