"""What vllm-ascend (vLLM's platform plugin for Ascend NPUs) cannot do for RL rollouts,
refused before any engine starts, in one line each.

Sources, vllm-ascend v0.23.0: its attention (``npu_fused_infer_attention_score``) takes
fp16 / bf16 only, so an fp32 engine fails deep inside the first forward.
"""

from __future__ import annotations

#: Rollout dtypes vllm-ascend's attention runs.
NPU_ROLLOUT_DTYPES = ("bf16", "fp16")


def refuse_rollout_dtype(dtype: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` (one line) unless a vllm engine on an NPU can run ``dtype`` (the
    trainer's ``precision.dtype``, which the engine is started in)."""
    if dtype not in NPU_ROLLOUT_DTYPES:
        raise error(f"precision.dtype={dtype} with rollout.engine=vllm on an Ascend NPU: vllm-ascend's attention "
                    "(npu_fused_infer_attention_score) takes fp16 / bf16 only; set precision.dtype=bf16, or "
                    "rollout.engine=hf for an fp32 rollout")
