"""``portarl bench async``'s accounting on hand-made runs: the budget cut (first step not
counted), samples per second, the ideal overlap, and a report from existing runs."""

from __future__ import annotations

import argparse
import json

import pytest

from portarl.bench.async_rollout import budget_rows, curve, main, summarize


def _write_run(path, step_s, rollout_s=None, rewards=None):
    path.mkdir(parents=True)
    with (path / "metrics.jsonl").open("w") as f:
        for i, s in enumerate(step_s):
            row = {"step": i + 1, "phase": "grpo", "time/step_s": s, "reward/mean": (rewards or step_s)[i]}
            if rollout_s is not None:
                row["time/rollout_s"] = rollout_s
            f.write(json.dumps(row) + "\n")


def test_budget_leaves_out_the_first_step_and_stops_inside_the_budget(tmp_path):
    _write_run(tmp_path / "run", [30.0, 1.0, 1.0, 1.0, 1.0])
    rows = budget_rows(tmp_path / "run", 3.0)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    s = summarize(rows, samples_per_step=10)
    assert s["samples"] == 40 and s["samples_per_s"] == pytest.approx(30 / 3.0)
    assert curve(rows, 4, chunks=2) == [pytest.approx(15.5), pytest.approx(1.0)]


def test_report_from_existing_runs_gives_the_ideal_overlap(tmp_path):
    _write_run(tmp_path / "colocated" / "run", [5.0] + [1.0] * 6, rollout_s=0.4, rewards=[0.1] * 7)
    _write_run(tmp_path / "async" / "run", [5.0] + [0.8] * 8, rewards=[0.2] * 9)
    args = argparse.Namespace(config=None, set=["train.prompts_per_step=2", "rollout.group_size=4"], budget_s=6.0,
                              threads=1, work_dir=str(tmp_path), reuse=True, out=None)
    result, table = main(args, progress=lambda _: None)
    assert result["samples_per_step"] == 8
    assert result["speedup_ideal"] == pytest.approx(1.0 / 0.6)  # (R + T) / max(R, T), R 0.4, T 0.6
    assert result["speedup_measured"] == pytest.approx((7 / 5.6) / (6 / 6.0))
    assert "measured 1.25x, ideal 1.67x" in table
