"""Reward models and judges under torchrun (issue 50), 2 Gloo ranks on the CPU: each rank
loads its own reward model and calls the one judge for its own samples (every sample of a
step judged once, by the rank that trains on it); FSDP2 wraps the policy only, and the
sharded checkpoint holds nothing of the reward model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))

from judge_server import JudgeServer  # noqa: E402
from portarl.assets.reward_models import build_tiny_reward_model  # noqa: E402
from test_fsdp_gloo import _train  # noqa: E402

SAMPLES_PER_STEP = 16  # train.prompts_per_step 4 x rollout.group_size 4 (test_fsdp_gloo.FAST), 8 per rank


def test_two_ranks_score_with_a_reward_model_each_and_one_shared_judge(tmp_path):
    rm = build_tiny_reward_model(tmp_path / "tiny-rm")
    with JudgeServer() as server:
        done = _train(tmp_path / "run", 2, "train.steps=2",
                      f"rewards=[{{model: '{rm}', weight: 0.5}}, {{judge: '{server.url}', model: j, name: judge}}]")
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(server.requests) == 2 * SAMPLES_PER_STEP  # each sample judged once, by its own rank
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all({"reward/tiny-rm", "reward/judge"} <= set(r) for r in rows)
    saved = "\n".join(p.name for p in (tmp_path / "run" / "checkpoints").rglob("*"))
    metadata = b"".join(p.read_bytes() for p in (tmp_path / "run" / "checkpoints").rglob(".metadata"))
    assert b"embed_tokens" in metadata  # the policy's keys are there (the check below can see keys)
    assert b"score.weight" not in metadata and "tiny-rm" not in saved
