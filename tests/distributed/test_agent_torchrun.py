"""Multi-turn episodes under torchrun (issue 37), 2 Gloo ranks on the CPU: each rank plays
its groups' episodes, which end after different numbers of turns on different ranks, yet
every rank runs the same generate calls (FSDP forwards are collective: the rank with fewer
running episodes pads its batch), and one step matches one process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from test_fsdp_gloo import ATOL, RTOL, _env, _rows, _train, assert_trained  # noqa: E402

TRAINER_TESTS = Path(__file__).parents[1] / "trainer"
sys.path.insert(0, str(TRAINER_TESTS))

from agent_tiny import save_agent_run_files  # noqa: E402


@pytest.fixture(scope="module")
def agent_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent-dp")
    model, data = save_agent_run_files(root)
    sets = [f"model.path={model}", f"data.path={data}", "environment=agent_tools:CountEnv",
            "rewards=[{name: environment}]", "rollout.max_turns=3", "rollout.max_new_tokens=12", "train.steps=1",
            "logging.samples_count=16"]
    env = _env(PYTHONPATH=os.pathsep.join([str(TRAINER_TESTS), str(Path(__file__).parent),
                                           os.environ.get("PYTHONPATH", "")]))
    runs = {}
    for ranks in (1, 2):
        out = root / f"ranks{ranks}"
        proc = _train(out, ranks, *sets, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[ranks] = out
    return runs


@pytest.mark.compares_runs
def test_one_multiturn_step_on_two_ranks_matches_one_process(agent_runs):
    assert_trained(agent_runs[1], agent_runs[2])
    one, two = (_rows(agent_runs[r])[0] for r in (1, 2))
    assert one["agent/turns_mean"] > 1 and 0 < one["agent/finish_done_frac"] < 1  # episodes of unequal lengths
    for key in ("reward/mean", "agent/turns_mean", "agent/env_steps", "agent/model_token_frac", "kl", "loss",
                "grad_norm", "mismatch/abs_diff_max"):
        assert two[key] == pytest.approx(one[key], rel=RTOL, abs=ATOL), key


def test_ranks_ran_different_numbers_of_turns(agent_runs):
    """The lock step was needed: the two ranks' episodes (rank 0: the first half of the
    step's samples, rank 1: the second) did not end at the same turns, so at some turn one
    rank had fewer episodes running than the other."""
    rows = [json.loads(line) for line in (agent_runs[1] / "samples.jsonl").read_text().splitlines()]
    half = len(rows) // 2
    assert half and sorted(r["turns"] for r in rows[:half]) != sorted(r["turns"] for r in rows[half:])
