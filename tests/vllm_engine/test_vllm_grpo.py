"""Two GRPO steps on the vllm engine with truncated importance sampling, end to end: step 2
samples the weights of step 1's update (a reward with spread within groups, and the guard of
tests/run_guard.py: with the default rewards every gradient was 0), and vLLM's log-probs
equal the trainer's at both steps."""

from __future__ import annotations

import json

import pytest

from vllm_tiny import NO_VLLM, TRAIN_SETS
from vllm_trained import assert_step_1_moved, checkpoints, spread_reward

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)

from portarl.parity.tolerances import ROLLOUT_FP32_ATOL


@pytest.mark.compares_runs
def test_two_grpo_steps_with_truncated_is(tmp_path, monkeypatch):
    from portarl.trainer import GRPOTrainer, TrainConfig, build_from_config

    sets = [*TRAIN_SETS, "train.steps=2", "loss.mismatch_mode=token_truncate", "logging.progress=false",
            "logging.tensorboard=false", "logging.plot=false", f"output_dir={tmp_path}", spread_reward(monkeypatch),
            *checkpoints(2)]
    cfg = TrainConfig.load(None, sets)
    model, tok, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tok, None, examples, cfg, device="cpu")
    try:
        trainer.train()
    finally:
        engine = trainer.rollout
    engine.close()
    assert trainer.rollout.name == "vllm" and trainer.rollout.weights_version >= 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["skipped"] == 0 for r in rows)
    assert_step_1_moved(tmp_path, "step 1 of the truncated-IS run")  # (replaces "some parameter changed")
    for r in rows:
        assert r["mismatch/abs_diff_max"] < ROLLOUT_FP32_ATOL and "mismatch/kl_k3" in r and "mismatch/masked_frac" in r
