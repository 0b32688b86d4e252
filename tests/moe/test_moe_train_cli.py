"""Tiny mixture-of-experts models from the command line (issue 48): Qwen3-MoE and Qwen2-MoE
(shared expert) train 2 steps colocated, and with routing replay in the asynchronous
rollout worker, whose recorded experts travel with its batch (compactly: int16, base64):
at staleness 0 the trainer's log-probs equal the worker's, also after the trained weights
were synced to it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import run_guard
from portarl.cli import main
from portarl.moe.models import BUILTIN_MOES
from portarl.moe.routing import experts_from_json, experts_json
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL

SHORT = ["--set", "train.steps=2", "--set", "train.prompts_per_step=4", "--set", "rollout.group_size=4",
         "--set", "rollout.max_new_tokens=4", "--set", "data.synthetic_size=64"]


def _grpo(run):
    return [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if m.get("phase") == "grpo"]


@pytest.mark.compares_runs
@pytest.mark.parametrize("name", list(BUILTIN_MOES))
@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_tiny_moe_trains_with_routing_replay(tmp_path, monkeypatch, name, mode):
    """A reward that varies within groups from the start weights (no supervised warm-up: the
    guard's start is then the run's own, rebuilt from its config); async at staleness 0, so
    that the second step's batch comes from the worker after the first step's trained
    weights were synced to it."""
    trainer_dir = str(Path(__file__).resolve().parents[1] / "trainer")  # trainer_fast, in the worker's process too
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([trainer_dir, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(trainer_dir)
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--set", f"model.path={name}", "--set", f"rollout.mode={mode}",
                 "--set", "rollout.routing_replay=rollout", "--set", "train.old_logprobs=recompute",
                 "--set", "rewards=[{name: 'trainer_fast:varied_reward'}]", "--set", "train.sft_warmup_steps=0",
                 *(["--set", "rollout.max_staleness=0"] if mode == "async" else []), *SHORT]) == 0
    rows = _grpo(run)
    assert [m["step"] for m in rows] == [1, 2]
    run_guard.assert_run_trained(run, what=f"{name} {mode}")
    assert 0.0 < rows[0]["rollout/routing_agreement"] <= 1.0
    for m in rows:  # staleness 0: the engine's own numbers, at the start weights and after the first update
        assert m.get("rollout/staleness_max", 0) == 0, m["rollout/staleness_max"]
        assert m["mismatch/abs_diff_max"] <= ROLLOUT_FP32_ATOL, (m["step"], m["mismatch/abs_diff_max"])


def test_recorded_experts_round_trip_through_json_and_refuse_damage():
    recorded = [torch.randint(0, 4, (2, 7, 2), dtype=torch.int16), torch.randint(0, 4, (2, 3, 2), dtype=torch.int16)]
    back = experts_from_json(json.loads(json.dumps(experts_json(recorded))))
    assert all(torch.equal(a, b) for a, b in zip(recorded, back))
    damaged = experts_json(recorded)
    damaged[1]["shape"] = [2, 4, 2]
    with pytest.raises(ValueError, match="sample 1"):
        experts_from_json(damaged)


def test_a_bad_routing_replay_value_is_refused(capsys):
    assert main(["train", "--set", "rollout.routing_replay=R3"]) == 2
    assert "rollout.routing_replay" in capsys.readouterr().err


def test_recorded_experts_travel_in_replay_files(tmp_path):
    from portarl.rollout.base import RolloutBatch
    from portarl.rollout.replay import load_rollouts, save_rollouts

    experts = [torch.randint(0, 4, (2, n, 2), dtype=torch.int16) for n in (5, 3)]
    batch = RolloutBatch([[1, 2, 3], [1, 2]], [[4, 5, 6], [7, 8]], [[-0.1] * 3, [-0.2] * 2], [True, False],
                         routed_experts=experts)
    save_rollouts([batch], tmp_path / "r.safetensors")
    back = load_rollouts(tmp_path / "r.safetensors")[0][0]
    assert all(torch.equal(a, b) for a, b in zip(experts, back.routed_experts))
