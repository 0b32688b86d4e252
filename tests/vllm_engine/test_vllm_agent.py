"""Multi-turn episodes on the vllm engine (issue 37), colocated and async: each turn one
vLLM generate over the running episodes, the trajectory kept as vLLM's token ids plus the
appended ones, and the trainer's log-probs of the model's tokens within the rollout fp32
tolerance of vLLM's at both steps, step 2 on the weights of step 1's update.

Issue 58: the environment's reward (replies seen) can be the same for every episode of a
group; ``agent_tools:reward_final_length`` is added so that step 1 has a gradient, and the
guard (tests/run_guard.py) checks that it moved the weights step 2's sync carries."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from vllm_tiny import NO_VLLM, TINY
from vllm_trained import assert_step_1_moved, checkpoints

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)

from portarl.parity.tolerances import ROLLOUT_FP32_ATOL  # noqa: E402

TRAINER_TESTS = Path(__file__).parents[1] / "trainer"
sys.path.insert(0, str(TRAINER_TESTS))

from agent_tiny import save_agent_run_files  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_agent_run_files(tmp_path_factory.mktemp("agent-vllm"), **TINY)  # a head size vLLM's CPU supports


@pytest.mark.compares_runs
@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_vllm_multiturn_episodes_score_the_engines_tokens(tmp_path, model_dir, mode, monkeypatch):
    from portarl.trainer import GRPOTrainer, TrainConfig, build_from_config

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TRAINER_TESTS), os.environ.get("PYTHONPATH", "")]))
    model_path, data = model_dir
    cfg = TrainConfig.load(None, [
        "rollout.engine=vllm", f"rollout.mode={mode}", f"model.path={model_path}",
        f"data.path={data}", "environment=agent_tools:CountEnv",
        "rewards=[{name: environment}, {name: 'agent_tools:reward_final_length'}]", *checkpoints(2),
        "rollout.max_turns=3", "rollout.max_new_tokens=12", "rollout.group_size=4", "train.prompts_per_step=2",
        "train.steps=2", "train.sft_warmup_steps=0", "rollout.vllm_gpu_memory_utilization=0.1",
        "rollout.max_staleness=0", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
        f"output_dir={tmp_path}"])
    model, tok, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tok, None, examples, cfg, device="cpu")
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["skipped"] == 0 for r in rows)
    assert_step_1_moved(tmp_path, f"the {mode} multi-turn run's step 1")
    assert max(r["agent/turns_mean"] for r in rows) > 1 and all(r["agent/model_token_frac"] < 1 for r in rows)
    for r in rows:
        assert r["mismatch/abs_diff_max"] < ROLLOUT_FP32_ATOL, r["step"]  # the model's tokens, as vLLM sampled them
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and all("conversation" in s for s in samples)
