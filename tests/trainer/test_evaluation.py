"""Evaluation during training (eval.data / eval.every / eval.n / eval.greedy) and
``portarl eval``: the metrics, their cadence, the best checkpoint, the logs, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import run_guard
from portarl.trainer import GRPOTrainer, build_from_config
from portarl.trainer.config import ConfigError
from portarl.trainer.phases.evaluation import eval_seeds
from trainer_fast import fast_config


def _eval_file(tmp_path, n=5):
    path = tmp_path / "held_out.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 7)][:n]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trainer(tmp_path, *overrides):
    cfg = fast_config(tmp_path, *overrides)
    model, tokenizer, examples = build_from_config(cfg)
    return GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")


def test_eval_seeds_fixed_and_distinct():
    assert eval_seeds(0, 3, 2) == eval_seeds(0, 3, 2)
    assert len(set(eval_seeds(0, 30, 4))) == 120


def test_eval_during_training(tmp_path):
    data = _eval_file(tmp_path)
    trainer = _trainer(tmp_path, f"eval.data={data}", "eval.every=2", "eval.greedy=false", "eval.n=3",
                       "train.steps=3", "logging.plot=true", "logging.tensorboard=true")
    result = trainer.train()
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in rows if "eval/reward/mean" in r]
    assert evaluated == [2, 3]  # every 2 steps, and after the last
    row = next(r for r in rows if r["step"] == 2)
    assert row["eval/prompts"] == 5
    for key in ("eval/reward/math_exact", "eval/reward/format", "eval/reward/best_of_n", "eval/completion/len_mean"):
        assert key in row, key
    assert row["eval/reward/best_of_n"] >= row["eval/reward/mean"]
    assert row["eval/reward/mean"] == pytest.approx(row["eval/reward/math_exact"] + 0.1 * row["eval/reward/format"], abs=1e-6)
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["metric"] == "eval/reward/mean"
    assert best["value"] == max(r["eval/reward/mean"] for r in rows if "eval/reward/mean" in r)
    assert (out / "best" / "checkpoints" / f"step-{best['step']:06d}" / "COMPLETE").exists()
    assert "eval/reward/mean" in result.summary
    assert (out / "curves.png").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("eval/reward/mean")] == [2, 3], scalars


def test_eval_greedy_is_deterministic_and_scored_with_the_training_rewards(tmp_path):
    from portarl.trainer.phases.evaluation import Evaluator

    data = _eval_file(tmp_path)
    trainer = _trainer(tmp_path, f"eval.data={data}")
    first = trainer.evaluator.run(trainer)
    again = Evaluator(trainer).run(trainer)
    assert first == again
    assert first["eval/prompts"] == 5 and "eval/reward/best_of_n" not in first


def test_bad_eval_settings(tmp_path):
    with pytest.raises(ConfigError, match="eval.n"):
        fast_config(tmp_path, "eval.n=4")  # greedy by default
    with pytest.raises(FileNotFoundError, match="eval.data"):
        _trainer(tmp_path, f"eval.data={tmp_path / 'missing.jsonl'}")
    with pytest.raises(ConfigError, match="eval.best_metric"):
        fast_config(tmp_path, "eval.best_metric=reward/mean")


@pytest.mark.compares_runs
def test_portarl_eval_cli(tmp_path, capsys):
    """``portarl eval`` of the saved checkpoint gives the numbers of the trainer's own
    weights; those moved from the start (a reward that varies within groups: with the
    built-in ones an untrained model's step changes nothing, and the initial weights would
    give the same numbers)."""
    data = _eval_file(tmp_path, 3)
    trainer = _trainer(tmp_path, "train.steps=1", "rewards=[{name: 'trainer_fast:varied_reward'}]")
    trainer.train()
    ckpt = tmp_path / "run"
    run_guard.assert_run_trained(ckpt, what="the run portarl eval reads")
    here_dir = os.path.dirname(__file__)  # trainer_fast, for the evaluation in its own process
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([here_dir, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "portarl", "eval", "--checkpoint", str(ckpt), "--data", str(data),
                          "--device", "cpu", "--out", str(tmp_path / "m.json")], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["eval/prompts"] == 3 and "eval/reward/mean" in metrics
    # The same numbers as the in-training evaluation of the same weights.
    from portarl.trainer.phases.evaluation import evaluate, load_eval_set

    import dataclasses

    trainer.config.eval = dataclasses.replace(trainer.config.eval, data=str(data))
    examples, ids = load_eval_set(trainer.config, trainer.codec, None)
    with torch.no_grad():
        here = evaluate(trainer.rollout, trainer.model, trainer.codec, trainer.rewards, examples, ids, trainer.config)
    assert here == pytest.approx(metrics)
    from portarl.cli import main

    assert main(["eval", "--checkpoint", str(tmp_path / "nope"), "--data", str(data)]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(ckpt), "--data", str(data), "--n", "4", "--greedy", "true"]) == 2
    assert "--greedy false" in capsys.readouterr().err
    from portarl.trainer.phases.evaluation import eval_checkpoint

    sampled = eval_checkpoint(ckpt, str(data), n=2, device="cpu")  # --n 2 alone: sampled
    assert sampled["eval/prompts"] == 3 and "eval/reward/best_of_n" in sampled


def test_portarl_eval_finds_the_runs_own_reward_module_from_any_directory(tmp_path, monkeypatch):
    """A `module:function` reward beside the config file: training finds it there (the
    config's directory), and `portarl eval` run from another directory finds it through the
    directory the checkpoint recorded."""
    project = tmp_path / "project"
    project.mkdir()
    module = f"eval_dir_reward_{os.getpid()}"  # a name no other test imports
    (project / f"{module}.py").write_text("def score(prompt, completion, answer):\n    return float(len(completion))\n")
    config = project / "run.yaml"
    config.write_text(f"rewards:\n  - name: {module}:score\n")
    from trainer_fast import FAST
    from portarl.trainer import TrainConfig

    cfg = TrainConfig.load(config, [*FAST, f"output_dir={tmp_path / 'run'}", "train.steps=1"])
    model, tokenizer, examples = build_from_config(cfg)
    GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu").train()
    sys.modules.pop(module, None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(project))])
    from portarl.trainer.phases.evaluation import eval_checkpoint

    try:
        metrics = eval_checkpoint(tmp_path / "run", str(_eval_file(tmp_path, 2)), device="cpu")
    finally:
        sys.modules.pop(module, None)
    assert metrics["eval/prompts"] == 2 and metrics["eval/reward/mean"] > 0
