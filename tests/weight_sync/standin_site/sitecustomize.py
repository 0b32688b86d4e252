"""Puts the STAND-IN of vLLM's NCCL / HCCL communicators (tests/weight_sync/standin_vllm.py)
in place at the start of a child process, where ``PORTARL_TEST_STANDIN_VLLM`` names the
directory its calls are logged to: an async rollout worker started by a test's trainer
joins the weight-sync group through the same stand-in as the trainer. Not a hardware test."""

import os
import sys

if os.environ.get("PORTARL_TEST_STANDIN_VLLM"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import standin_vllm

    standin_vllm.install(os.environ["PORTARL_TEST_STANDIN_VLLM"])
