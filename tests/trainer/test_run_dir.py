"""Issue 13, items 1 and 2: one run per output directory; what --resume may change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portarl.cli import main
from portarl.trainer.run.output_dir import RunDirError, apply_learning_rate, check_output_dir, config_changes
from trainer_fast import FAST


def _args(out: Path, *extra: str) -> list[str]:
    sets = [x for item in FAST if not item.startswith("train.steps") for x in ("--set", item)]
    return ["train", "--device", "cpu", "--output-dir", str(out), *sets, "--set", "checkpoint.every=2", *extra]


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _ckpts(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_reusing_an_output_dir_is_refused_then_overwrite_and_resume(tmp_path, capsys):
    """The issue's repro, scaled down: a run with checkpoints, then a second run into the same
    directory without --resume. It used to mix the runs (keep_last pruned the new run's
    checkpoints, metrics were overwritten, a later --resume continued the old run)."""
    out = tmp_path / "ref"
    assert main(_args(out, "--steps", "4")) == 0
    assert _ckpts(out) == ["step-000002", "step-000004"] and _steps(out) == [1, 2, 3, 4]
    capsys.readouterr()

    env = {**os.environ}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "portarl", *_args(out, "--steps", "3")], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "already holds a run" in lines[0] and "--resume" in lines[0] and "--overwrite" in lines[0]
    assert "step-000004" in lines[0]
    assert _ckpts(out) == ["step-000002", "step-000004"] and _steps(out) == [1, 2, 3, 4], "nothing touched"

    assert main(_args(out, "--steps", "3", "--overwrite")) == 0
    assert _ckpts(out) == ["step-000002", "step-000003"] and _steps(out) == [1, 2, 3]
    assert main(_args(out, "--steps", "5", "--resume")) == 0
    assert _steps(out) == [1, 2, 3, 4, 5]
    assert main(_args(out, "--resume", "--overwrite")) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_overwrite_removes_only_what_a_run_writes(tmp_path):
    from portarl.trainer.run.output_dir import clear_run

    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="already holds a run"):
        check_output_dir(tmp_path)
    clear_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    check_output_dir(tmp_path)  # now free


def test_resume_applies_lr_and_steps_and_says_so(tmp_path, capsys, caplog):
    out = tmp_path / "run"
    assert main(_args(out, "--steps", "2", "--set", "optim.lr=1e-3")) == 0
    first = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["lr"] for r in first} == {1e-3}
    with caplog.at_level("INFO", logger="portarl.train"):
        assert main(_args(out, "--resume", "--steps", "4", "--set", "optim.lr=3e-3",
                          "--set", "checkpoint.keep_last=3")) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in rows[2:]] == [3e-3, 3e-3], "the resumed run trains at the new learning rate"
    applied = [r.getMessage() for r in caplog.records if "applied changed settings" in r.getMessage()]
    assert len(applied) == 1
    for field in ("optim.lr", "train.steps", "checkpoint.keep_last"):
        assert field in applied[0]


def test_resume_refuses_other_changes_naming_the_fields(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(out, "--steps", "2")) == 0
    capsys.readouterr()
    assert main(_args(out, "--resume", "--steps", "3", "--set", "model.hidden_size=16",
                      "--set", "model.intermediate_size=32", "--set", "loss.kl_coef=0.5")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1
    for field in ("model.hidden_size", "model.intermediate_size", "loss.kl_coef"):
        assert field in err[0]
    assert "train.steps" not in err[0].split("cannot change mid-run")[1].split("Only")[0]
    assert _steps(out) == [1, 2]


def test_config_changes_split():
    saved = {"train": {"steps": 10, "seed": 0}, "optim": {"lr": 1e-3}, "logging": {"plot": True},
             "output_dir": "a", "rewards": [{"name": "math_exact", "weight": 1.0}]}
    new = {"train": {"steps": 20, "seed": 1}, "optim": {"lr": 1e-3}, "logging": {"plot": False},
           "output_dir": "b", "rewards": [{"name": "format", "weight": 1.0}]}
    applicable, refused = config_changes(saved, new)
    assert [f for f, _, _ in applicable] == ["logging.plot", "train.steps"]
    assert [f for f, _, _ in refused] == ["rewards", "train.seed"]


def test_apply_learning_rate_keeps_the_schedule_position():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 ** i)
    for _ in range(3):
        opt.step()
        sched.step()
    apply_learning_rate(opt, sched, 8.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)  # 8 * 0.5**3
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_library_resume_without_a_checkpoint_is_refused_unless_start_if_none(make_trainer):
    trainer = make_trainer("train.steps=1")
    with pytest.raises(RunDirError, match=r"--resume: no checkpoint in .*checkpoints to continue from"):
        trainer.train(resume=True)
    assert trainer.train(resume=True, start_if_none=True).steps == 1
