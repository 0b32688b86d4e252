"""Issue 13, items 9 and 10: each event once at its level, no nan for metrics that do not
apply, no third-party bars, logging fields validated, bench outputs outside bench/results."""

from __future__ import annotations

import logging

import pytest

from portarl.trainer import ConfigError, TrainConfig
from portarl.trainer.run.logger import RunLogger, _postfix, event_level, plot_curves, summarize


def _rows(with_accuracy: bool):
    rows = []
    for step in range(1, 21):
        row = {"step": step, "phase": "grpo", "reward/mean": step / 20, "kl": 0.01, "grad_norm": 1.0, "skipped": 0}
        if with_accuracy:
            row["reward/math_exact"] = step / 40
        rows.append(row)
    return rows


def test_summary_leaves_out_accuracy_without_math_exact():
    without = summarize(_rows(False))
    assert "accuracy" not in without and "nan" not in without
    assert "reward/mean" in without
    with_acc = summarize(_rows(True))
    assert "accuracy" in with_acc and "nan" not in with_acc


def test_summary_of_an_agent_run_says_what_an_episode_did():
    """The one-minute agents recipe (docs/agents.md) shows in its summary that the tools and
    the environment ran; a run without them gets no such line."""
    rows = _rows(False)
    for row in rows:
        row.update({"agent/tool_calls": 0.5 if row["step"] <= 10 else 1.0, "agent/tool_success_frac": 1.0,
                    "agent/env_steps": 1.0, "agent/turns_mean": 2.0})
    text = summarize(rows)
    assert ("per episode   first 10 steps: tool calls 0.50, tool success 1.00, environment steps 1.00, turns 2.00   "
            "last 10 steps: tool calls 1.00") in text
    assert "per episode" not in summarize(_rows(False))


def test_plot_has_no_empty_accuracy_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    made = []
    real = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: made.append(a) or real(*a, **k))
    assert plot_curves(_rows(False), tmp_path / "a.png").exists()
    assert plot_curves(_rows(True), tmp_path / "b.png").exists()
    assert [a[1] for a in made] == [3, 4]  # reward, kl, grad norm (+ accuracy with math_exact)


def test_bar_postfix_leaves_out_missing_metrics():
    assert _postfix({"reward/mean": 0.5, "kl": float("nan")}) == {"reward": "0.500", "skip": 0}


def test_each_event_once_at_its_level(tmp_path, caplog, capsys):
    logger = RunLogger(tmp_path, total_steps=3, progress=True, tensorboard=False)
    assert logger.bar is None, "the GRPO bar starts at the first GRPO step (after any SFT warm-up)"
    with caplog.at_level(logging.DEBUG, logger="portarl.train"):
        logger.step({"step": 1, "reward/mean": 0.1})
        assert logger.bar is not None
        logger.event(1, "kl_spike", "kl spike: 1 > median 0.1")
        logger.event(1, "grad_norm_spike", "grad_norm spike", action="skip")
        logger.event(1, "skipped_step", "skipped the optimizer step")
        logger.close()
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "portarl.train"]
    assert records == [(logging.INFO, "step 1: kl spike: 1 > median 0.1"),
                       (logging.WARNING, "step 1: grad_norm spike"),
                       (logging.WARNING, "step 1: skipped the optimizer step")]
    assert capsys.readouterr().err.count("kl spike") <= 1  # never also written through the bar
    assert event_level("stopped") == logging.DEBUG  # raised as TrainingStopped, reported once by the caller


def test_transformers_progress_bars_are_turned_off():
    transformers_logging = pytest.importorskip("transformers.utils.logging")
    from portarl.trainer.run.progress import quiet_third_party

    transformers_logging.enable_progress_bar()
    quiet_third_party()
    assert not transformers_logging.is_progress_bar_enabled()


@pytest.mark.parametrize("field", ["progress", "tensorboard", "plot"])
def test_logging_fields_validated(field):
    with pytest.raises(ConfigError, match=f"logging.{field} must be true or false"):
        TrainConfig.load(None, [f"logging.{field}=maybe"])


def test_bench_outputs_default_outside_committed_results(tmp_path, monkeypatch, capsys):
    from portarl.cli import build_parser, main
    from portarl.cli.bench import BENCH_OUT

    assert not BENCH_OUT.startswith("bench/results")
    assert build_parser().parse_args(["bench", "stability"]).out.startswith(BENCH_OUT)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "kernels", "--device", "cpu", "--quick", "--repeats", "1", "--dtypes", "fp32"]) == 0
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json"))
    assert len(written) == 1 and written[0].startswith(f"{BENCH_OUT}/kernels-")
    assert not (tmp_path / "bench").exists()
