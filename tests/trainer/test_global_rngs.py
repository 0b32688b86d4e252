"""The global generators (Python's ``random``, NumPy's, torch's default) are seeded from
``train.seed`` at the start of a run, in the trainer and in each async rollout worker, so a
reward that draws from them gives the same values in two runs of one config; a resumed run
takes them from its checkpoint instead (seeding must not override that)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from portarl.trainer import GRPOTrainer, build_from_config

import run_guard
from trainer_fast import fast_config

HERE = Path(__file__).parent
REWARD = "rewards=[{name: 'trainer_fast:global_rng_reward'}]"


def _rewards(out: Path) -> list[float]:
    return [json.loads(line)["reward/mean"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]


def _train(tmp_path: Path, *sets: str, resume: bool = False) -> list[float]:
    cfg = fast_config(tmp_path, REWARD, "checkpoint.every=1", *sets)
    model, tokenizer, examples = build_from_config(cfg)
    GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu").train(resume=resume, overwrite=not resume)
    return _rewards(tmp_path)


def _stir() -> None:
    """Move every global generator, as whatever ran in the process before a run would."""
    random.random(), np.random.rand(3), torch.rand(5)


@pytest.mark.compares_runs
@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_two_runs_of_one_config_draw_the_same_global_randomness(tmp_path, monkeypatch, mode):
    if mode == "async":  # the reward runs in the worker, which finds trainer_fast on its path
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    first = _train(tmp_path / "a", "train.steps=2", f"rollout.mode={mode}")
    _stir()
    second = _train(tmp_path / "b", "train.steps=2", f"rollout.mode={mode}")
    # the random reward varies within every group: both runs train
    for run in ("a", "b"):
        run_guard.assert_run_trained(tmp_path / run / "run", what=f"{mode} run {run}")
    assert first == second and len(set(first)) == 2, (first, second)


@pytest.mark.compares_runs
def test_a_resumed_run_continues_the_checkpoints_global_randomness(tmp_path):
    whole = _train(tmp_path / "whole", "train.steps=3")
    _train(tmp_path / "cut", "train.steps=2")
    _stir()
    resumed = _train(tmp_path / "cut", "train.steps=3", resume=True)
    run_guard.assert_run_trained(tmp_path / "whole" / "run", what="the uninterrupted run")
    run_guard.assert_run_trained(tmp_path / "cut" / "run", what="the resumed run")
    assert resumed == whole, (resumed, whole)
