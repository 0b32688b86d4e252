"""Two GRPO steps on the vllm engine with truncated importance sampling, end to end."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_tiny import NO_VLLM, TINY

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)

from portarl.parity.tolerances import ROLLOUT_FP32_ATOL


def test_two_grpo_steps_with_truncated_is(tmp_path):
    from portarl.trainer import GRPOTrainer, TrainConfig, build_from_config

    sets = ["rollout.engine=vllm", "train.steps=2", "train.prompts_per_step=3", "rollout.group_size=4",
            "rollout.max_new_tokens=3", "train.sft_warmup_steps=2", "data.synthetic_size=32",
            f"model.hidden_size={TINY['hidden_size']}", f"model.heads={TINY['heads']}", f"model.kv_heads={TINY['kv_heads']}",
            f"model.intermediate_size={TINY['intermediate_size']}", "loss.mismatch_mode=token_truncate",
            "rollout.vllm_gpu_memory_utilization=0.1", "logging.progress=false", "logging.tensorboard=false",
            "logging.plot=false", f"output_dir={tmp_path}"]
    cfg = TrainConfig.load(None, sets)
    model, tok, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tok, None, examples, cfg, device="cpu")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    try:
        trainer.train()
    finally:
        engine = trainer.rollout
    engine.close()
    assert trainer.rollout.name == "vllm" and trainer.rollout.weights_version >= 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["skipped"] == 0 for r in rows)
    for r in rows:
        assert r["mismatch/abs_diff_max"] < ROLLOUT_FP32_ATOL and "mismatch/kl_k3" in r and "mismatch/masked_frac" in r
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
