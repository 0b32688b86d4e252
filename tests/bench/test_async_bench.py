"""``portarl bench async``'s accounting on hand-made runs: the budget cut (first step not
counted), samples per second, the ideal overlap in wall and CPU time, the same-cores
comparison, and a report from existing runs."""

from __future__ import annotations

import argparse
import json

import pytest

from portarl.bench.async_rollout import budget_rows, curve, main, summarize


def _write_run(path, step_s, rollout_s=None, rewards=None, **cpu):
    """``cpu``: constant values of ``time/step_cpu_s``, ``time/rollout_cpu_s``, ``rollout/cpu_s`` (by their
    last name part)."""
    names = {"step_cpu_s": "time/step_cpu_s", "rollout_cpu_s": "time/rollout_cpu_s", "worker_cpu_s": "rollout/cpu_s"}
    path.mkdir(parents=True)
    with (path / "metrics.jsonl").open("w") as f:
        for i, s in enumerate(step_s):
            row = {"step": i + 1, "phase": "grpo", "time/step_s": s, "reward/mean": (rewards or step_s)[i]}
            if rollout_s is not None:
                row["time/rollout_s"] = rollout_s
            row.update({names[k]: v for k, v in cpu.items()})
            f.write(json.dumps(row) + "\n")


def test_budget_leaves_out_the_first_step_and_stops_inside_the_budget(tmp_path):
    _write_run(tmp_path / "run", [30.0, 1.0, 1.0, 1.0, 1.0])
    rows = budget_rows(tmp_path / "run", 3.0)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    s = summarize(rows, samples_per_step=10)
    assert s["samples"] == 40 and s["samples_per_s"] == pytest.approx(30 / 3.0)
    assert curve(rows, 4, chunks=2) == [pytest.approx(15.5), pytest.approx(1.0)]
    assert len(curve(rows, 3, chunks=5)) == 3  # fewer common steps than spans: one span a step, no more


def _args(tmp_path, **kw):
    return argparse.Namespace(config=None, set=["train.prompts_per_step=2", "rollout.group_size=4"], budget_s=6.0,
                              threads=1, work_dir=str(tmp_path), reuse=True, out=None, **kw)


def test_report_from_existing_runs_gives_the_ideal_overlap(tmp_path):
    """Runs from before the CPU-time metrics and without a same-cores run: wall time only."""
    _write_run(tmp_path / "colocated" / "run", [5.0] + [1.0] * 6, rollout_s=0.4, rewards=[0.1] * 7)
    _write_run(tmp_path / "async" / "run", [5.0] + [0.8] * 8, rewards=[0.2] * 9)
    result, table = main(_args(tmp_path), progress=lambda _: None)
    assert result["samples_per_step"] == 8
    assert result["speedup_ideal"] == pytest.approx(1.0 / 0.6)  # (R + T) / max(R, T), R 0.4, T 0.6
    assert result["speedup_measured"] == pytest.approx((7 / 5.6) / (6 / 6.0))
    assert "measured 1.25x in samples per second, ideal 1.67x" in table
    assert "speedup_cpu" not in result and "speedup_same_cores" not in result


def test_both_comparisons_in_wall_and_cpu_time(tmp_path):
    """A core per process: wall (samples/s) and CPU time (the colocated step's CPU over the larger of the
    async trainer's step and the worker's batch), each beside its ideal; the same cores: samples/s."""
    _write_run(tmp_path / "colocated" / "run", [5.0] + [1.0] * 6, rollout_s=0.4, rewards=[0.1] * 7,
               step_cpu_s=0.9, rollout_cpu_s=0.3)
    _write_run(tmp_path / "async" / "run", [5.0] + [0.8] * 8, rewards=[0.2] * 9, step_cpu_s=0.75, worker_cpu_s=0.35)
    _write_run(tmp_path / "colocated_same_cores" / "run", [5.0] + [0.5] * 12, rollout_s=0.2, rewards=[0.1] * 13)
    result, table = main(_args(tmp_path, same_cores=True), progress=lambda _: None)
    assert result["speedup_cpu"] == pytest.approx(0.9 / 0.75)
    assert result["speedup_ideal_cpu"] == pytest.approx(0.9 / 0.6)  # R 0.3, T 0.6 of CPU
    assert result["cpu_of_ideal"] == pytest.approx((0.9 / 0.75) / (0.9 / 0.6))
    assert result["measured_of_ideal"] == pytest.approx(result["speedup_measured"] / result["speedup_ideal"])
    assert result["speedup_same_cores"] == pytest.approx((7 / 5.6) / (12 / 6.0))  # async 1.25, same cores 2.0 samples/s
    assert "In process CPU time: 1.20x against an ideal 1.50x (0.80 of it" in table
    assert "**The same cores** (async 1 + 1 threads against colocated 2): 0.62x" in table
    assert result["colocated_same_cores"]["threads"] == 2


def test_the_partial_run_is_compared_with_async_and_colocated(tmp_path):
    _write_run(tmp_path / "colocated" / "run", [5.0] + [1.0] * 6, rollout_s=0.4, rewards=[0.1] * 7)
    _write_run(tmp_path / "async" / "run", [5.0] + [0.8] * 8, rewards=[0.2] * 9)
    _write_run(tmp_path / "partial" / "run", [5.0] + [0.5] * 12, rewards=[0.2] * 13)
    _write_run(tmp_path / "partial_carry" / "run", [5.0] + [1.0] * 6, rewards=[0.2] * 7)
    result, table = main(_args(tmp_path, partial=True, lengths="tail:8:512"), progress=lambda _: None)
    assert result["partial_vs_async"] == pytest.approx((12 / 6.0) / (7 / 5.6))
    assert result["partial_vs_colocated"] == pytest.approx((12 / 6.0) / (6 / 6.0))
    assert result["partial_carry_vs_async"] == pytest.approx((6 / 6.0) / (7 / 5.6))
    assert "**Partial rollouts, partial** (rollout.partial, 1 + 1" in table and "1.60x async's samples per second" in table
    assert "**Partial rollouts, partial_carry** (rollout.partial, max_staleness 2" in table and "0.80x async's" in table
    assert "(completion lengths tail:8:512, set by the benchmark)" in table
