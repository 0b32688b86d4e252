"""What the trainer asks of any rollout engine, and the vllm engine's settings checks.

The lifecycle (sync before each rollout, sleep after it, mark stale after every optimizer
step, close at the end) is checked here with a recording engine over the hf engine; the vllm
engine's own behaviour on real vLLM is in tests/vllm_engine (`make test-vllm`). The
argument checks below run without vLLM installed: they happen before vLLM is imported.
"""

from __future__ import annotations

import pytest
import torch

from portarl.rollout import HFRollout, RolloutEngine
from portarl.rollout.vllm import VLLMRollout, engine_kwargs, vllm_unavailable_reason
from portarl.trainer import ConfigError, TrainConfig


class CallLog(RolloutEngine):
    """Delegates to an hf engine and records the lifecycle calls in order."""

    name = "call-log"

    def __init__(self, inner: HFRollout):
        self.inner, self.calls = inner, []

    def generate(self, prompts, seeds, params):
        self.calls.append("generate")
        return self.inner.generate(prompts, seeds, params)

    def sync_weights(self, model):
        self.calls.append("sync")

    def sleep(self):
        self.calls.append("sleep")

    def mark_trainer_updated(self):
        self.calls.append("updated")

    def close(self):
        self.calls.append("close")


def test_trainer_drives_the_engine_lifecycle(make_trainer):
    trainer = make_trainer("train.steps=2", "train.ppo_epochs=2")
    engine = CallLog(trainer.rollout)
    trainer.rollout = engine
    trainer.train()
    per_step = ["sync", "generate", "sleep", "updated", "updated"]
    assert engine.calls == per_step * 2
    trainer.close()
    assert engine.calls[-1] == "close"
    assert isinstance(trainer.rollout, HFRollout), "after close the configured engine is built anew"


def test_a_skipped_step_does_not_mark_the_engine_stale(make_trainer):
    trainer = make_trainer("train.steps=1")
    engine = CallLog(trainer.rollout)
    trainer.rollout = engine
    trainer.hooks["loss"].append(lambda step, t: t * float("nan"))
    trainer.train()
    assert engine.calls == ["sync", "generate", "sleep"]


def test_engine_kwargs_enforce_rl_settings(tmp_path):
    kw = engine_kwargs(tmp_path, dtype=torch.bfloat16, gpu_memory_utilization=0.2, max_model_len=80, seed=5)
    assert kw["logprobs_mode"] == "processed_logprobs", "raw log-probs ignore the temperature the trainer applies"
    assert kw["skip_tokenizer_init"] is True and kw["dtype"] == "bfloat16"
    assert kw["model"] == str(tmp_path) and kw["max_model_len"] == 80 and kw["seed"] == 5
    assert "enable_sleep_mode" not in kw and "additional_config" not in kw
    assert engine_kwargs(tmp_path, sleep_level=2)["enable_sleep_mode"] is True
    with pytest.raises(ValueError, match="float64"):
        engine_kwargs(tmp_path, dtype=torch.float64)


def test_reduce_sample_is_refused(tmp_path):
    with pytest.raises(ValueError, match="enable_reduce_sample"):
        engine_kwargs(tmp_path, additional_config={"enable_reduce_sample": True})
    # refused before vLLM is even needed
    with pytest.raises(ValueError, match="enable_reduce_sample"):
        VLLMRollout(tmp_path, eos_token_id=1, additional_config={"enable_reduce_sample": True})


def test_npu_turns_the_nz_weight_format_off(tmp_path):
    # bf16: vllm-ascend's attention takes fp16 / bf16 only (an fp32 engine is refused first)
    kw = engine_kwargs(tmp_path, npu=True, dtype=torch.bfloat16, additional_config={"rl_config": {"enabled": True}})
    assert kw["additional_config"] == {"rl_config": {"enabled": True}, "weight_nz_mode": 0}
    with pytest.raises(ValueError, match="weight_nz_mode"):
        engine_kwargs(tmp_path, npu=True, dtype=torch.bfloat16, additional_config={"weight_nz_mode": 2})
    # off the NPU the option is vllm-ascend's alone: passed through untouched
    assert engine_kwargs(tmp_path, additional_config={"x": 1})["additional_config"] == {"x": 1}


@pytest.mark.skipif(vllm_unavailable_reason() is None, reason="vLLM is installed here")
def test_missing_vllm_says_how_to_get_it(tmp_path):
    with pytest.raises(RuntimeError, match="make test-vllm"):
        VLLMRollout(tmp_path, eos_token_id=1)


def test_vllm_config_refuses_truncated_sampling():
    for bad in ("rollout.top_p=0.9", "rollout.top_k=20"):
        with pytest.raises(ConfigError, match="rollout.top_k / rollout.top_p"):
            TrainConfig.load(None, ["rollout.engine=vllm", bad])
    TrainConfig.load(None, ["rollout.engine=hf", "rollout.top_p=0.9"])  # the hf engine scores the full distribution


def test_vllm_additional_config_from_the_command_line():
    cfg = TrainConfig.load(None, ["rollout.engine=vllm", "rollout.vllm_additional_config.rl_config.enabled=true"])
    assert cfg.rollout.vllm_additional_config == {"rl_config": {"enabled": True}}
    with pytest.raises(ConfigError, match="rollout.vllm_additional_config"):
        TrainConfig.load(None, ["rollout.vllm_additional_config=[1, 2]"])
