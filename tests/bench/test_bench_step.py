"""Smoke runs of ``portarl bench step`` (tiny: 2 steps, one round); timings are not asserted,
only that every number is produced and consistent (phases within the step, equal threads)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from portarl.bench import step as bench_step  # noqa: E402
from portarl.bench.step_work import Work  # noqa: E402
from portarl.cli import main  # noqa: E402

TINY = ["--steps", "2", "--warmup", "1", "--rounds", "1", "--threads", "1"]


def _check_side(m: dict) -> None:
    assert m["cpu_s"] > 0 and m["wall_s"] > 0 and m["peak_rss_mib"] > 50
    for kind in ("cpu", "wall"):
        rollout, scoring, update = (m[f"{p}_{kind}_s"] for p in ("rollout", "scoring", "update"))
        assert rollout > 0 and scoring >= 0 and update > 0
        assert rollout + scoring <= m[f"{kind}_s"] + 1e-9


def test_bench_step_portarl(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", *TINY, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    _check_side(data["summary"]["portarl"])
    assert "trl" not in data["summary"] and "ratio_cpu" not in data["summary"]
    run = data["rounds"][0]["portarl"]
    assert run["torch_threads"] == 1 and len(run["steps"]) == 2
    assert "process CPU" in out.with_suffix(".md").read_text() and "portarl bench step" in capsys.readouterr().out


def test_bench_step_refuses_vs_trl_without_trl(monkeypatch, capsys):
    monkeypatch.setattr(bench_step, "trl_unavailable_reason", lambda: "trl is not installed")
    assert main(["bench", "step", "--vs", "trl", *TINY]) == 2
    assert "trl is not installed" in capsys.readouterr().err


def test_bench_step_checks_its_arguments(capsys):
    assert main(["bench", "step", "--steps", "2", "--warmup", "2"]) == 2
    assert main(["bench", "step", "--threads", "0"]) == 2
    assert "--warmup < --steps" in capsys.readouterr().err


@pytest.mark.skipif(bench_step.trl_unavailable_reason() is not None, reason="trl is not installed (portarl[bench])")
def test_bench_step_vs_trl(tmp_path):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--vs", "trl", *TINY, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for side in ("portarl", "trl"):
        _check_side(data["summary"][side])
        assert data["rounds"][0][side]["torch_threads"] == 1
    row = data["rounds"][0]
    steps = sorted((s for side in ("portarl", "trl") for s in row[side]["steps"]), key=lambda s: s["started_unix"])
    for before, after in zip(steps, steps[1:]):  # the sides stepped in turn, never at once
        assert before["started_unix"] + before["wall_s"] <= after["started_unix"]
    assert row["ratio_cpu"] == pytest.approx(row["portarl_median"]["cpu_s"] / row["trl_median"]["cpu_s"])
    assert "Median ratio" in out.with_suffix(".md").read_text()


FAKE_WORKER = """
import json, sys, time
from portarl.bench.step import RESULT, gate
impl, steps = sys.argv[1], int(sys.argv[2])
if impl == "broken":
    sys.exit("broken worker: no model for you")
records = []
for _ in range(steps):
    gate()
    t0, w0 = time.time(), time.perf_counter()
    while time.perf_counter() - w0 < 0.02:
        pass
    records.append({"impl": impl, "started_unix": t0, "wall_s": time.perf_counter() - w0})
print(RESULT + " " + json.dumps({"steps": records}), flush=True)
"""


def _fake_workers(monkeypatch):
    import sys

    monkeypatch.setattr(bench_step, "worker_command",
                        lambda impl, steps, threads, work: [sys.executable, "-c", FAKE_WORKER, impl, str(steps)])


def test_two_sides_take_their_steps_in_turn_swapping_who_goes_first(monkeypatch):
    """The driver's protocol (stand-in workers, no TRL needed): one process steps while the
    other waits, never both at once, and the first side swaps every step."""
    _fake_workers(monkeypatch)
    results = bench_step.run_in_turn(["a", "b"], 4, 1, Work())
    steps = sorted((s for r in results.values() for s in r["steps"]), key=lambda s: s["started_unix"])
    assert [s["impl"] for s in steps] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    for before, after in zip(steps, steps[1:]):
        assert before["started_unix"] + before["wall_s"] <= after["started_unix"]
    alone = bench_step.run_in_turn(["a"], 2, 1, Work())["a"]  # a side run on its own is not gated
    assert len(alone["steps"]) == 2


def test_a_worker_that_dies_is_reported_with_its_error(monkeypatch):
    _fake_workers(monkeypatch)
    with pytest.raises(RuntimeError, match="(?s)worker broken failed.*no model for you"):
        bench_step.run_in_turn(["a", "broken"], 2, 1, Work())
