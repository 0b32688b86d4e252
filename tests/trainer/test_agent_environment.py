"""Stateful environments in multi-turn episodes (issue 37): one per episode from the
factory, reset with the data row, stepped with each reply, owning the reward; a row naming
its environment; an environment that fails ends its episode with a message and a metric."""

from __future__ import annotations

import pytest

from agent_tiny import ScriptedRollout, agent_tokenizer, tiny_model
from portarl.data import Example
from portarl.trainer import GRPOTrainer, TrainConfig
from portarl.trainer.config import ConfigError
from portarl.trainer.phases.rollout import run_rollout
from trainer_fast import fast_config


def _trainer(tmp_path, script, *overrides, rows=None):
    tok = agent_tokenizer()
    model = tiny_model(len(tok))
    cfg = fast_config(tmp_path, "rewards=[{name: environment}]", "rollout.group_size=2", "train.prompts_per_step=2",
                      "rollout.max_turns=4", "loss.kl_coef=0", *overrides)
    rows = rows or [Example([{"role": "user", "content": "Count"}], None, {"level": 1}, "row 1")]
    return GRPOTrainer(model, tok, None, rows, cfg, device="cpu", rollout_engine=ScriptedRollout(model, tok, script))


def test_the_environment_steps_every_reply_and_owns_the_reward(tmp_path):
    trainer = _trainer(tmp_path, ["one", "two", "three", "four"], "environment=agent_tools:CountEnv")
    metrics = trainer.train_step()
    episode = trainer.last_samples["episodes"][0]
    assert [(m["role"], m["content"]) for m in episode["messages"]] == [
        ("assistant", "one"), ("user", "again"), ("assistant", "two"), ("user", "again"), ("assistant", "three")]
    assert episode["finish"] == "done" and episode["env_reward"] == 3.0
    assert metrics["reward/environment"] == 3.0 and metrics["agent/env_steps"] == 3  # per episode
    assert metrics["agent/finish_done_frac"] == 1 and all(trainer.last_samples["finished"])


def test_reset_text_joins_the_prompt_and_rows_name_their_environment(tmp_path):
    rows = [Example([{"role": "user", "content": "Count"}], None, {"environment": "count"}, "row 1"),
            Example([{"role": "user", "content": "Guess"}], None, {"environment": "greet"}, "row 2")]
    trainer = _trainer(tmp_path, ["one", "two", "three"], "environment={count: 'agent_tools:CountEnv', "
                       "greet: 'agent_tools:GreetEnv'}", rows=rows)
    rollout = run_rollout(trainer, 1).rollout
    by_env = {}
    for prompt, episode in zip(rollout.prompt_ids, rollout.episodes):
        by_env.setdefault(episode["turns"], []).append(trainer.tokenizer.decode(prompt))
    assert by_env[1] and all("Guess\n\nSay hello." in p for p in by_env[1])  # GreetEnv: one reply, then done
    assert by_env[3] and all(p.endswith("Count<|im_end|>\n<|im_start|>assistant\n") for p in by_env[3])


@pytest.mark.parametrize("isolation", ["none", "process"])
def test_a_failing_environment_ends_its_episode_with_a_message_and_the_run_goes_on(tmp_path, isolation):
    trainer = _trainer(tmp_path, ["one", "two"], "environment=agent_tools:BrokenEnv",
                       f"rollout.tool_isolation={isolation}")
    try:
        for _ in range(2):
            metrics = trainer.train_step()
            episode = trainer.last_samples["episodes"][0]
            # the error ended the episode after the model's turn: the model never read it
            assert episode["unread"] == [{"role": "user", "content": "Error: the environment's step raised "
                                          "RuntimeError: the environment broke"}]
            assert [m["role"] for m in episode["messages"]] == ["assistant"]
            assert episode["finish"] == "env_error" and metrics["agent/env_errors"] == 1  # every episode
            assert metrics["reward/environment"] == 0.0 and metrics["skipped"] == 0
            assert any(kind == "tool_errors" for kind, _, _ in metrics["_events"])
    finally:
        trainer.close()


@pytest.mark.parametrize("overrides, message", [
    (["rewards=[{name: environment}]"], "built-in reward 'environment' needs an environment"),
    (["environment=[1, 2]"], "environment must be 'module:factory' or a mapping"),
    (["tools=[calculator]"], "tools must be a list of 'module:function'"),
    (["tools=['m:f']", "rollout.dynamic_sampling=true"], "rollout.dynamic_sampling with tools"),
    (["tools=['m:f']", "shaping.overlong_buffer=2"], "shaping.overlong_buffer with tools"),
    (["rollout.tool_isolation=docker"], "rollout.tool_isolation must be 'none' or 'process'"),
    (["rollout.max_turns=0"], "rollout.max_turns must be an integer > 0"),
    (["rollout.tool_format=xml"], "rollout.tool_format must be one of"),
])
def test_environment_settings_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.load(None, overrides)


def test_a_row_naming_an_unknown_environment_is_refused(tmp_path):
    rows = [Example([{"role": "user", "content": "Count"}], None, {"environment": "chess"}, "row 1")]
    trainer = _trainer(tmp_path, ["one"], "environment={count: 'agent_tools:CountEnv'}", rows=rows)
    with pytest.raises(ValueError, match="names environment 'chess'.*has 'count'"):
        run_rollout(trainer, 1)


def test_a_prompt_that_outgrows_the_context_with_its_reset_text_is_named(tmp_path):
    # (the default rollout.max_tool_tokens cuts the reset text to fit: tests/trainer/test_agent_observations.py)
    trainer = _trainer(tmp_path, ["one"], "environment=agent_tools:LongResetEnv", "rollout.max_tool_tokens=8192")
    with pytest.raises(ValueError, match="row 1: the prompt is 50.. tokens .*does not fit the engine's 4096 positions"):
        run_rollout(trainer, 1)
