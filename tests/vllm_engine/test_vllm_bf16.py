"""A bf16 vLLM engine differs measurably from the fp32 trainer (its own module: one engine at a time)."""

from __future__ import annotations

import pytest
import torch

from vllm_tiny import NO_VLLM, TINY

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)

from portarl.assets.models import build_tiny, save_local
from portarl.parity.tolerances import ROLLOUT_BF16_MIN_MEAN_DIFF
from portarl.rollout import SamplingParams, request_seeds
from portarl.rollout.vllm import VLLMRollout
from portarl.trainer.phases.sequences import build_batch, completion_logprobs

PROMPTS = ["3+4=", "12+7=", "5+5="]
G = 6


def test_bf16_engine_differs_measurably(tmp_path):
    model, tok = build_tiny(seed=0, **TINY)
    save_local(model, tok, tmp_path)
    engine = VLLMRollout(tmp_path, eos_token_id=tok.eos_token_id, dtype=torch.bfloat16, gpu_memory_utilization=0.1,
                         max_model_len=64)
    try:
        prompts = [tok.encode(p) for p in PROMPTS for _ in range(G)]
        out = engine.generate(prompts, request_seeds(0, 3, len(PROMPTS), G), SamplingParams(max_new_tokens=6))
    finally:
        engine.close()
    batch = build_batch(out.prompt_ids, out.completion_ids, tok.pad_token_id, "cpu")
    with torch.no_grad():
        ours = completion_logprobs(model, batch, temperature=1.0)  # fp32 trainer
    theirs = torch.zeros_like(ours)
    for i, lps in enumerate(out.logprobs):
        theirs[i, : len(lps)] = torch.tensor(lps)
    mean_diff = (ours - theirs).abs()[batch.mask].mean()
    assert mean_diff > ROLLOUT_BF16_MIN_MEAN_DIFF, f"bf16 engine mean |d logp| {mean_diff:.2e}"
