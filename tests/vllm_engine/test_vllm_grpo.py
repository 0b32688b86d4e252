"""Two GRPO steps on the vllm engine with truncated importance sampling, end to end."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_tiny import NO_VLLM, TRAIN_SETS

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)

from portarl.parity.tolerances import ROLLOUT_FP32_ATOL


def test_two_grpo_steps_with_truncated_is(tmp_path):
    from portarl.trainer import GRPOTrainer, TrainConfig, build_from_config

    sets = [*TRAIN_SETS, "train.steps=2", "loss.mismatch_mode=token_truncate", "logging.progress=false",
            "logging.tensorboard=false", "logging.plot=false", f"output_dir={tmp_path}"]
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
