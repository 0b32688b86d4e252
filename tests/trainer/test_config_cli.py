"""Training config: bad values give an error naming the field, in Python and on the CLI."""

from __future__ import annotations

import pytest

from portarl.cli import main
from portarl.trainer import ConfigError, TrainConfig


@pytest.mark.parametrize(
    "override,field",
    [
        ("train.steps=0", "train.steps"),
        ("train.steps=ten", "train.steps"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.seed_mode=fixed", "rollout.seed_mode"),
        ("optim.schedule=linear", "optim.schedule"),
        ("optim.lr=-1", "optim.lr"),
        ("precision.dtype=fp8", "precision.dtype"),
        ("precision.loss_scale=-2", "precision.loss_scale"),
        ("loss.clip_eps_high=0", "clip_eps_high"),
        ("loss.policy_loss=dpo", "policy_loss"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last"),
        ("optim.learning_rate=1e-3", "optim.learning_rate"),
        ("trainer.steps=3", "trainer"),
        ("rollout.group_size=1", "rollout.group_size"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        TrainConfig.load(None, [override])


def test_yaml_file_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 7\noptim:\n  lr: 5e-4\nloss:\n  kl_coef: 0.0\n  policy_loss: gspo\n")
    cfg = TrainConfig.load(path, ["train.prompts_per_step=2"])
    assert (cfg.train.steps, cfg.optim.lr, cfg.loss.policy_loss, cfg.train.prompts_per_step) == (7, 5e-4, "gspo", 2)
    cfg.save(tmp_path / "saved.yaml")
    assert TrainConfig.load(tmp_path / "saved.yaml") == cfg


def test_cli_reports_bad_config(capsys, tmp_path):
    assert main(["train", "--set", "train.steps=0", "--output-dir", str(tmp_path)]) == 2
    assert "train.steps must be an integer > 0" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_cli_train_runs_and_summarises(capsys, tmp_path):
    from trainer_fast import FAST

    args = ["train", "--device", "cpu", "--output-dir", str(tmp_path / "run")]
    for item in FAST:
        args += ["--set", item]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "reward/mean" in out and "checkpoint" in out


def test_cli_stops_with_exit_3(tmp_path, capsys):
    from trainer_fast import FAST

    args = ["train", "--device", "cpu", "--output-dir", str(tmp_path / "run"), "--set", "train.steps=10",
            "--set", "rewards=[{name: 'tests_trainer_nan_reward:always_nan'}]"]
    for item in FAST:
        if not item.startswith("train.steps"):
            args += ["--set", item]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert "stopping at step 1: reward 'tests_trainer_nan_reward:always_nan' returned nan, expected a finite number on " \
           "sample 0 (prompt '" in err


def test_cli_sft_saves_a_loadable_model(tmp_path, capsys):
    from trainer_fast import FAST

    args = ["sft", "--device", "cpu", "--output-dir", str(tmp_path), "--steps", "3"]
    for item in FAST:
        args += ["--set", item]
    assert main(args) == 0
    from portarl.assets.models import load_local

    model, tok = load_local(tmp_path / "sft-model")
    assert tok.encode("1+1=")[0] == tok.bos_token_id


def test_a_loss_override_keeps_the_trainers_other_loss_defaults():
    """`--set loss.policy_loss=cispo` once rebuilt the section from GRPOConfig's defaults and
    silently switched the trainer's default KL (0.001) off."""
    from portarl.trainer.config import TrainConfig

    default = TrainConfig.load(None, [])
    changed = TrainConfig.load(None, ["loss.policy_loss=cispo"])
    assert changed.loss.policy_loss == "cispo" and changed.loss.kl_coef == default.loss.kl_coef == 0.001
    assert TrainConfig.load(None, ["loss.kl_coef=0"]).loss.kl_coef == 0.0
