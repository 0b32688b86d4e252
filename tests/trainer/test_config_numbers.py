"""Every numeric field of every section accepts exponent notation (YAML 1.1 reads `1e-3`
as a string) and is range-checked with a message naming the field; optim.eps is
validated; optim.warmup_ratio; the adaptive KL controller."""

from __future__ import annotations

import dataclasses
import decimal

import pytest

from portarl.core import GRPOConfig
from portarl.core.kl_control import AdaptiveKLController, make_kl_controller
from portarl.trainer import ConfigError, TrainConfig

_SECTIONS = ("model", "data", "rollout", "train", "optim", "precision", "guards", "checkpoint")


def _exponent_form(value) -> str:
    """`28e-2` for 0.28, `64e0` for 64: no dot, so YAML 1.1 yields a string."""
    sign, digits, exp = decimal.Decimal(repr(value)).as_tuple()
    return f"{'-' if sign else ''}{int(''.join(map(str, digits)))}e{exp}"


def _numeric_fields():
    cfg = TrainConfig()
    for section in _SECTIONS:
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            if str(f.type).split(" |")[0] in ("int", "float") and isinstance(value, (int, float)) and not isinstance(value, bool):
                yield f"{section}.{f.name}", value
    for f in dataclasses.fields(GRPOConfig):
        value = getattr(cfg.loss, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"loss.{f.name}", value


NUMERIC = list(_numeric_fields())


def test_the_field_list_is_complete():
    names = {n for n, _ in NUMERIC}
    assert {"loss.kl_coef", "loss.clip_eps_high", "optim.eps", "optim.lr", "train.steps", "guards.spike_factor",
            "optim.warmup_ratio", "loss.kl_horizon", "train.mini_batches"} <= names


@pytest.mark.parametrize("field,value", NUMERIC, ids=[n for n, _ in NUMERIC])
def test_exponent_notation_is_a_number(field, value):
    text = _exponent_form(value)
    cfg = TrainConfig.load(None, [f"{field}={text}"])
    section, name = field.split(".")
    got = getattr(getattr(cfg, section), name)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("override,message", [
    ("loss.kl_coef=1e-3", None),
    ("optim.eps=1e-4", None),
    ("optim.eps=-1", "optim.eps must be > 0.0"),
    ("optim.eps=0", "optim.eps must be > 0.0"),
    ("optim.eps=abc", "optim.eps must be a finite number"),
    ("loss.kl_coef=-1e-3", "loss.kl_coef must be >= 0.0"),
    ("loss.kl_coef=lots", "loss.kl_coef must be a number"),
    ("loss.clip_eps_low=1e0", "loss.clip_eps_low must be < 1.0"),
    ("loss.kl_horizon=0", "loss.kl_horizon must be > 0"),
    ("train.steps=15e-1", "train.steps must be an integer"),
    ("optim.beta2=1e0", "optim.beta2 must be in"),
    ("optim.warmup_ratio=1", "optim.warmup_ratio must be in"),
    ("rollout.top_p=nan", "rollout.top_p must be a finite number"),
    ("guards.spike_action=panic", "guards.spike_action must be log, skip or stop"),
    ("train.mini_batches=1000", "train.mini_batches must be at most"),
    ("precision.master_weights_fp32=maybe", "precision.master_weights_fp32 must be auto, true or false"),
    ("precision.loss_scale=65536e0", None),
])
def test_values_are_range_checked_naming_the_field(override, message):
    if message is None:
        TrainConfig.load(None, [override])
        return
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        TrainConfig.load(None, [override])


def test_warmup_steps_and_ratio_are_exclusive():
    with pytest.raises(ConfigError, match="optim.warmup_steps / optim.warmup_ratio"):
        TrainConfig.load(None, ["optim.warmup_steps=3", "optim.warmup_ratio=0.1"])


def test_kl_target_needs_a_start_coefficient():
    with pytest.raises(ConfigError, match="loss.kl_target needs kl_coef > 0"):
        TrainConfig.load(None, ["loss.kl_coef=0", "loss.kl_target=6e0"])


def test_adaptive_kl_controller_follows_the_ppo_rule():
    ctl = AdaptiveKLController(0.1, target=0.02, horizon=1000)
    ctl.update(0.04, n=100)  # kl / target - 1 = 1, clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    ctl.update(0.019, n=100)  # -0.05
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 0.1) * (1 - 0.05 * 0.1))
    before = ctl.value
    ctl.update(float("nan"), n=100)
    assert ctl.value == before
    assert make_kl_controller(GRPOConfig(kl_coef=0.1)).value == 0.1


def test_trainer_adapts_the_kl_coefficient(make_trainer):
    trainer = make_trainer("loss.kl_coef=0.1", "loss.kl_target=1e-3", "loss.kl_horizon=100")
    coef = 0.1
    n = trainer.config.train.prompts_per_step * trainer.config.rollout.group_size
    for _ in range(2):
        metrics = trainer.train_step()
        error = min(max(metrics["kl"] / 1e-3 - 1, -0.2), 0.2)
        coef *= 1 + error * n / 100
        assert metrics["kl/coef"] == pytest.approx(coef, rel=1e-12)
    from portarl.trainer.run.persistence import trainer_state

    assert trainer_state(trainer)["kl_ctl"] == {"value": trainer.kl_ctl.value}


def _bool_fields():
    cfg = TrainConfig()
    for section in (*_SECTIONS, "logging", "loss"):
        for f in dataclasses.fields(getattr(cfg, section)):
            if str(f.type).replace(" ", "") == "bool":
                yield section, f.name


# Switches that only make sense beside another setting: turning them on alone is refused by design.
_FLIP_NEEDS = {"rollout.partial": ["rollout.mode=async"]}


@pytest.mark.parametrize("section, name", list(_bool_fields()))
def test_every_bool_field_refuses_a_non_bool_naming_the_field(section, name, tmp_path):
    with pytest.raises(ConfigError, match=rf"(GRPOConfig|{section})\.{name} must be true or false, got 'maybe'"):
        TrainConfig.load(None, [f"output_dir={tmp_path}", f"{section}.{name}=maybe"])
    flipped = not getattr(getattr(TrainConfig(), section), name)
    needs = _FLIP_NEEDS.get(f"{section}.{name}", []) if flipped else []
    loaded = TrainConfig.load(None, [f"output_dir={tmp_path}", *needs, f"{section}.{name}={str(flipped).lower()}"])
    assert getattr(getattr(loaded, section), name) is flipped
