"""Stateful environments in multi-turn episodes (issue 37): one per episode from the
factory, reset with the data row, stepped with each reply, owning the reward; a row naming
its environment; an environment that fails ends its episode with a message and a metric.
Issue 44: one that fails every episode of a step stops the run; its failures are counted
alike by agent/env_errors, agent/finish_env_error_frac and the warning; factories and rows
are checked before the model loads (the command-line cases: tests/cli/test_first_hour_errors.py)."""

from __future__ import annotations

import re

import pytest

from agent_tiny import ScriptedRollout, agent_tokenizer, tiny_model
from portarl.assets.data import Example
from portarl.trainer import GRPOTrainer, TrainConfig, TrainingStopped
from portarl.trainer.config import ConfigError
from portarl.trainer.phases.rollout import run_rollout
from trainer_fast import fast_config


def _trainer(tmp_path, script, *overrides, rows=None, engine=ScriptedRollout):
    tok = agent_tokenizer()
    model = tiny_model(len(tok))
    cfg = fast_config(tmp_path, "rewards=[{name: environment}]", "rollout.group_size=2", "train.prompts_per_step=2",
                      "rollout.max_turns=4", "loss.kl_coef=0", *overrides)
    rows = rows or [Example([{"role": "user", "content": "Count"}], None, {"level": 1}, "row 1")]
    return GRPOTrainer(model, tok, None, rows, cfg, device="cpu", rollout_engine=engine(model, tok, script))


class UnfinishedRollout(ScriptedRollout):
    """The scripted replies, each reported as cut at rollout.max_new_tokens (no end token)."""

    def generate(self, prompts, seeds, params):
        batch = super().generate(prompts, seeds, params)
        batch.finished = [False] * len(prompts)
        return batch


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
    """Half the episodes' environments fail (agent_faulty_envs.FlakyEnv): those end with a
    message and env_error, the others play on, and the run goes on."""
    trainer = _trainer(tmp_path, ["one", "two"], "environment=agent_faulty_envs:FlakyEnv",
                       f"rollout.tool_isolation={isolation}")
    try:
        for _ in range(2):
            metrics = trainer.train_step()
            episodes = trainer.last_samples["episodes"]
            failed = [ep for ep in episodes if ep["finish"] == "env_error"]
            assert len(failed) == 2 and all(ep["finish"] == "done" for ep in episodes if ep not in failed)
            # the error ended the episode after the model's turn: the model never read it
            assert all(ep["unread"] == [{"role": "user", "content": "Error: the environment's step raised "
                                         "RuntimeError: flaky step"}] for ep in failed)
            assert all([m["role"] for m in ep["messages"]] == ["assistant"] for ep in failed)
            assert metrics["agent/env_errors"] == metrics["agent/finish_env_error_frac"] == 0.5
            assert metrics["reward/environment"] == 1.5 and metrics["skipped"] == 0  # (3 + 3 + 0 + 0) / 4
            [(_, message, fields)] = [e for e in metrics["_events"] if e[0] == "tool_errors"]
            assert message.startswith("the environment failed in 2 of 4 episode(s) in this batch"), message
            assert fields["env_errors"] == 2 and fields["value"] == 0
    finally:
        trainer.close()


@pytest.mark.parametrize("env, problem", [
    ("agent_tools:BrokenEnv", "step raised RuntimeError: the environment broke"),
    ("agent_faulty_envs:UnclosableEnv", "close raised OSError: cannot close"),
])
def test_an_environment_that_fails_every_episode_of_a_step_stops_the_run(tmp_path, env, problem):
    """It used to fail every episode, log a warning each step and end with exit 0 having
    trained on nothing; now it stops as a failing reward does (TrainingStopped: exit 3)."""
    trainer = _trainer(tmp_path, ["one"], f"environment={env}", "train.steps=2")
    with pytest.raises(TrainingStopped) as stopped:
        trainer.train()
    assert str(stopped.value).startswith(f"stopping at step 1: environment {env!r} failed in all 4 of its episodes "
                                         f"of this step (the first: {problem})"), stopped.value
    assert stopped.value.tensor_name == "user_code" and stopped.value.checkpoint.name == "step-000000"


def test_a_reset_that_fails_ends_its_episode_with_env_error_and_the_counts_agree(tmp_path):
    """A failed reset still plays one turn (the sample needs the model's tokens); that turn
    cut at max_new_tokens used to make the episode a "length" one, so agent/env_errors read
    0.5 while agent/finish_env_error_frac read 0, and the warning said "0 call(s) failed"."""
    trainer = _trainer(tmp_path, ["one"], "environment=agent_faulty_envs:FlakyResetEnv", engine=UnfinishedRollout)
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
    finishes = sorted(ep["finish"] for ep in trainer.last_samples["episodes"])
    assert finishes == ["env_error", "env_error", "length", "length"]
    assert metrics["agent/env_errors"] == metrics["agent/finish_env_error_frac"] == 0.5
    [(_, message, _)] = [e for e in metrics["_events"] if e[0] == "tool_errors"]
    assert message == ("the environment failed in 2 of 4 episode(s) in this batch; each failed environment ended its "
                       "episode (the error is under 'unread' in the sample log); the run goes on. First: environment: reset raised "
                       "RuntimeError: flaky reset")


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


@pytest.mark.parametrize("env, message", [
    ("agent_faulty_envs:NoStepEnv", "environment: 'agent_faulty_envs:NoStepEnv' has no step() method"),
    ("agent_faulty_envs:SizedEnv",
     "environment: 'agent_faulty_envs:SizedEnv' takes 1 argument (size), portarl passes 0"),
    ("agent_faulty_envs", "environment: 'agent_faulty_envs' must be 'module:name'"),
])
def test_a_factory_that_cannot_make_an_environment_is_refused_when_the_trainer_is_built(tmp_path, env, message):
    """(Also with the trainer as a library, where no check before the model loads ran.)"""
    with pytest.raises(ValueError, match=re.escape(message)):
        _trainer(tmp_path, ["one"], f"environment={env}")


def _examples(n: int = 2, **columns) -> list:
    return [Example("1+1=", "2", {"answer": "2", **columns}, f"rows.jsonl:{i + 1}") for i in range(n)]


def test_a_factory_function_is_called_once_before_the_model_loads_and_its_object_closed():
    from portarl.trainer.start import preflight
    from agent_faulty_envs import COUNTED

    before = dict(COUNTED)
    cfg = TrainConfig.load(None, ["environment=agent_faulty_envs:make_counted"])
    preflight.check_agent_code(cfg, _examples(), cfg.code_search_dirs())
    assert (COUNTED["made"] - before["made"], COUNTED["closed"] - before["closed"]) == (1, 1)
    isolated = TrainConfig.load(None, ["environment=agent_faulty_envs:make_counted", "rollout.tool_isolation=process"])
    preflight.check_agent_code(isolated, _examples(), isolated.code_search_dirs())  # its code stays out of this process
    assert COUNTED["made"] - before["made"] == 1


def test_a_factory_that_hangs_when_checked_is_named_with_its_time_limit():
    from portarl.trainer.start import preflight

    cfg = TrainConfig.load(None, ["environment=agent_faulty_envs:make_slowly", "rollout.tool_timeout_s=0.5"])
    with pytest.raises(ValueError, match=r"environment: 'agent_faulty_envs:make_slowly': the factory did not return "
                                         r"within rollout.tool_timeout_s=0.5 s"):
        preflight.check_agent_code(cfg, _examples(), cfg.code_search_dirs())


def test_rows_of_an_environment_mapping_are_checked_against_its_names():
    from portarl.multiturn.environment import check_rows

    check_rows(_examples(environment="count"), ["count", "greet"])
    check_rows(_examples(), [None])  # a single environment: no column needed
    with pytest.raises(ValueError, match="rows.jsonl:1: the data row has no 'environment' column"):
        check_rows(_examples(), ["count"])
    with pytest.raises(ValueError, match="rows.jsonl:1: the data row names environment 'chess'.*has 'count'"):
        check_rows(_examples(environment="chess"), ["count"])


def test_every_episode_means_the_steps_over_every_rank():
    """Under torchrun ``total`` sums the counts over ranks: an environment whose episodes all
    failed on this rank but not on another does not stop the run; one of a mapping that
    failed everywhere does, named by its field, whatever the other environments did."""
    from types import SimpleNamespace

    from agent_tools import CountEnv
    from portarl.multiturn.report import broken_environment

    def episode(name, failed):
        return SimpleNamespace(env_name=name, finish="env_error" if failed else "done",
                               env_error="step raised RuntimeError: no" if failed else None)

    factories = {"count": CountEnv, "other": CountEnv}
    mine = [episode("count", True), episode("count", True), episode("other", False)]
    elsewhere = [0, 0, 2, 1]  # another rank: no "count" episode; "other" failed 1 of 2

    def total(counts):
        return [a + b for a, b in zip(counts, elsewhere)]

    broken = broken_environment(mine, factories, total)
    assert str(broken).startswith("environment.count 'agent_tools:CountEnv' failed in all 2 of its episodes of this "
                                  "step (the first: step raised RuntimeError: no)"), broken
    assert broken_environment(mine, factories, lambda counts: [a + b for a, b in zip(counts, [3, 1, 0, 0])]) is None
    alone = broken_environment([episode("other", True)], factories, None)
    assert alone.what == "environment.other 'agent_tools:CountEnv'"
