"""Multi-turn episodes in rollout.mode=async (issue 37): the worker plays the episodes (its
environments run on its side) and at max_staleness 0 the run reproduces colocated mode
bitwise, the token-truth bound holding on the worker's trajectories."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import run_guard
from agent_tiny import save_agent_run_files
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL
from portarl.trainer import GRPOTrainer, build_from_config
from proc_tree import children, left_running, sleepers
from trainer_fast import fast_config

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the worker")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_agent_run_files(tmp_path_factory.mktemp("agent-model"))


def _run(path: Path, model_dir, *overrides: str) -> GRPOTrainer:
    model, data = model_dir
    cfg = fast_config(path, f"model.path={model}", f"data.path={data}",
                      "rewards=[{name: environment}]", "rollout.max_turns=3", "rollout.max_new_tokens=12",
                      "train.steps=2", *overrides)
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    trainer.train(overwrite=True)
    return trainer


@pytest.mark.compares_runs
def test_async_staleness_0_reproduces_colocated_episodes_bitwise(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    env = "environment=agent_tools:CountEnv"
    colocated_run = _run(tmp_path / "colocated", model_dir, env).output_dir
    colocated = _jsonl(colocated_run / "metrics.jsonl")
    run = _run(tmp_path / "async", model_dir, env, "rollout.mode=async", "rollout.max_staleness=0").output_dir
    run_guard.assert_run_trained(colocated_run, what="the colocated episodes")
    run_guard.assert_run_trained(run, what="the async episodes at max_staleness 0")
    rows = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and colocated[0]["agent/turns_mean"] > 1
    for ref, got in zip(colocated, rows):
        differ = {k: (v, got.get(k)) for k, v in ref.items()
                  if not k.startswith("time/") and k != "agent/tool_time_s" and k != "agent/tool_time_max_s"
                  and got.get(k) != v}
        assert not differ, f"step {ref['step']}: {differ}"
        assert got["mismatch/abs_diff_max"] < ROLLOUT_FP32_ATOL  # model tokens of the worker's trajectories
    samples = _jsonl(run / "samples.jsonl")
    assert samples[0]["conversation"] and samples[0]["turns"] >= 1
    assert not children(os.getpid()), "the worker outlived the run"


def test_async_environments_run_in_the_worker(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    run = _run(tmp_path, model_dir, "environment=agent_tools:PidEnv", "rollout.mode=async", "train.steps=1",
               "logging.samples_count=8").output_dir
    observations = [m["content"] for row in _jsonl(run / "samples.jsonl") for m in row["conversation"]
                    if m["role"] == "user"]
    assert observations
    pids = {int(text.split()[1]) for text in observations}
    assert len(pids) == 1 and os.getpid() not in pids


def test_an_environment_that_fails_every_episode_in_the_worker_is_named_as_user_code():
    """The worker reports it as it reports a failing reward (the trainer stops with exit 3
    and that line), not as a crash of its own with a traceback in its log."""
    from types import SimpleNamespace

    from portarl.rollout.async_worker import Worker
    from portarl.runtime.user_code import UserCodeError

    def generate(request):
        raise UserCodeError("environment 'agent_tools:BrokenEnv'", None, "failed in all 4 of its episodes of this step")

    reply = Worker.handle(SimpleNamespace(generate=generate, partial=None), {"op": "generate"})
    assert reply == {"op": "error", "kind": "reward",
                     "message": "environment 'agent_tools:BrokenEnv' failed in all 4 of its episodes of this step"}


def test_nothing_an_environment_started_in_the_worker_outlives_the_run(tmp_path, model_dir, monkeypatch):
    """The worker plays the episodes; what their environments started (a child, one in a
    session of its own, one a shell left behind) is in the worker's process tree (it is a
    subreaper) and ends with it. Before, the worker's SIGKILL left them running."""
    spawned = tmp_path / "spawned"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PORTARL_TEST_SPAWNED", str(spawned))
    _run(tmp_path, model_dir, "environment=agent_tools:SpawnEnv", "rollout.mode=async", "train.steps=1")
    pids = sleepers(spawned)
    assert pids and len(pids) % 3 == 0
    assert left_running(pids) == [], "processes an environment started outlived the run"
