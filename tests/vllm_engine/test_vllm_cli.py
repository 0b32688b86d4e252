"""`portarl train --set rollout.engine=vllm` from the command line, and the stability harness
over vLLM rollouts: mismatch metrics logged every step, and shown per run.

The runs train (issue 58): with the default rewards an untrained tiny model scores 0, every
gradient was 0, and "vLLM's log-probs equal the trainer's" at step 2 compared the weights
the engine already held. Here they score with a reward that differs within groups
(``trainer_fast:varied_reward``), and the guard (tests/run_guard.py) checks that step 1 moved
the weights that step 2's sync carries."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_tiny import NO_VLLM, TRAIN_SETS
from vllm_trained import SPREAD, assert_step_1_moved, checkpoints, pythonpath, spread_reward

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)

from portarl.cli import main  # noqa: E402
from portarl.parity.tolerances import ROLLOUT_BF16_MIN_MEAN_DIFF, ROLLOUT_FP32_ATOL  # noqa: E402

MISMATCH = ("mismatch/abs_diff_mean", "mismatch/abs_diff_max", "mismatch/kl_k3", "mismatch/masked_frac")


def _sets(*extra: str) -> list[str]:
    out = []
    for item in (*TRAIN_SETS, *extra):
        out += ["--set", item]
    return out


@pytest.mark.compares_runs
def test_portarl_train_with_the_vllm_engine(tmp_path):
    """Two steps: step 2's rollout runs on the weights of step 1's update (the guard), and
    vLLM's log-probs equal the trainer's at both."""
    cmd = [sys.executable, "-m", "portarl", "train", "--device", "cpu", "--output-dir", str(tmp_path),
           *_sets("train.steps=2", "logging.tensorboard=false", "logging.progress=false", SPREAD, *checkpoints(2))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": pythonpath()})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert_step_1_moved(tmp_path, "the colocated vllm run's step 1")
    for r in rows:
        assert all(key in r for key in MISMATCH), sorted(r)
        assert r["mismatch/abs_diff_max"] < ROLLOUT_FP32_ATOL, (r["step"], r["mismatch/abs_diff_max"])
    assert (tmp_path / "curves.png").exists()


@pytest.mark.compares_runs
def test_stability_harness_shows_the_mismatch_of_a_bf16_engine(tmp_path, capsys, monkeypatch):
    """The fp32 engine's mismatch stays within the fp32 bound over steps whose weights moved
    (the guard on both runs), the bf16 engine's does not."""
    reward = spread_reward(monkeypatch)
    args = ["bench", "stability", "--runs", "cpu:fp32,cpu:bf16", "--steps", "2", "--out", str(tmp_path),
            *_sets(reward, *checkpoints(2))]
    assert main(args) == 0
    for run in ("cpu_fp32", "cpu_bf16"):
        assert_step_1_moved(tmp_path / "runs" / run, f"the harness's {run} run, step 1")
    analysis = json.loads((tmp_path / "stability.json").read_text())
    by_label = {r["label"]: r for r in analysis["runs"]}
    assert by_label["cpu:fp32"]["mean_abs_dlogp"] < ROLLOUT_FP32_ATOL
    assert by_label["cpu:bf16"]["mean_abs_dlogp"] > ROLLOUT_BF16_MIN_MEAN_DIFF
    report = (tmp_path / "report.md").read_text()
    assert "mean abs d logp" in report and (tmp_path / "stability.png").exists()
    for run in ("cpu_fp32", "cpu_bf16"):
        rows = [json.loads(line) for line in (tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all(all(key in r for key in MISMATCH) for r in rows)
