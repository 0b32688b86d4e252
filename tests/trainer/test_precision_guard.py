"""Mixed precision by default, and the guard around the optimizer step: a non-finite
update (fp16 AdamW) is undone bitwise and blamed on ``optimizer_update`` with the first
bad parameter; no checkpoint is written from non-finite weights."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from portarl.trainer import ConfigError, TrainConfig
from portarl.trainer.guards.precision import PrecisionPlan


def _snapshot(trainer):
    masters = [m.detach().clone() for m in trainer.precision.masters] if trainer.precision.masters else []
    return ({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, masters,
            copy.deepcopy(trainer.optimizer.state_dict()))


def _assert_same(a, b):
    for name in a[0]:
        assert torch.equal(a[0][name], b[0][name]), name
    assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert a[2]["param_groups"] == b[2]["param_groups"]
    assert a[2]["state"].keys() == b[2]["state"].keys()
    for key in a[2]["state"]:
        for field, value in a[2]["state"][key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b[2]["state"][key][field])), (key, field)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_keeps_fp32_masters_by_default(dtype):
    cfg = TrainConfig.load(None, [f"precision.dtype={dtype}"])
    assert cfg.precision.master_weights_fp32 == "auto" and cfg.precision.use_master
    assert not TrainConfig.load(None, ["precision.dtype=bf16", "precision.master_weights_fp32=false"]).precision.use_master


def test_fp16_without_master_weights_is_refused():
    with pytest.raises(ConfigError, match=r"precision\.master_weights_fp32=false is refused with precision\.dtype=fp16"):
        TrainConfig.load(None, ["precision.dtype=fp16", "precision.master_weights_fp32=false"])


def _count_changed(before, model):
    return sum(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_bf16_small_lr_updates_every_parameter_with_masters(make_trainer):
    """The issue's case: bf16 at lr 5e-6. With fp32 masters (the default) every parameter
    moves; the optimizer state is fp32."""
    trainer = make_trainer("precision.dtype=bf16", "optim.lr=5e-6", "train.steps=2", "optim.grad_clip=null")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for _ in range(2):
        assert trainer.train_step()["skipped"] == 0
    masters_moved = sum(not torch.equal(m, before[n].float()) for n, m in zip(trainer.param_names, trainer.precision.masters))
    assert masters_moved == len(trainer.param_names)
    assert all(v.dtype == torch.float32 for st in trainer.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.is_floating_point())
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())


def test_bf16_without_masters_warns_and_measures_lost_updates(make_trainer, caplog):
    with caplog.at_level(logging.WARNING, logger="portarl.train"):
        trainer = make_trainer("precision.dtype=bf16", "precision.master_weights_fp32=false", "optim.lr=5e-6",
                               "guards.lost_frac_warn=0.3")
    assert "master_weights_fp32=false" in caplog.text
    trainer.train_step()
    metrics = trainer.train_step()
    assert metrics["skipped"] == 0
    # Adam's first steps move every value by ~lr = 5e-6, far below bf16's resolution (2^-8
    # relative): most of them are lost, and the metric says so.
    assert metrics["update/lost_frac"] > 0.3
    assert any(kind == "lost_updates" for kind, _, _ in metrics["_events"])


def _pure_fp16_adamw(trainer):
    """The issue's failure, rebuilt below the config (which refuses it): AdamW stepping fp16
    parameters with fp16 state, eps=1e-8 (0 in fp16), squared gradients underflowing."""
    trainer.precision = PrecisionPlan(trainer.model, "fp16", False, "dynamic")
    trainer.optimizer = torch.optim.AdamW(trainer.precision.optimizer_params(), lr=1e-3, eps=1e-8)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda i: 1.0)


def _record_first_bad_after_step(trainer):
    """Wrap optimizer.step to see the parameters right after it, before the guard restores."""
    seen = {}
    inner = trainer.optimizer.step

    def step(*args, **kwargs):
        out = inner(*args, **kwargs)
        for i, p in enumerate(trainer.precision.optimizer_params()):
            if not torch.isfinite(p).all():
                seen.setdefault("first", i)
        return out

    trainer.optimizer.step = step
    return seen


def test_fp16_adamw_update_is_undone_bitwise_and_blamed(make_trainer):
    trainer = make_trainer("precision.dtype=fp16", "optim.grad_clip=null")
    _pure_fp16_adamw(trainer)
    seen = _record_first_bad_after_step(trainer)
    before = _snapshot(trainer)
    metrics = trainer.train_step()
    assert "first" in seen, "the fp16 AdamW step did not produce a non-finite value: the test injects nothing"
    assert metrics["skipped"] == 1 and metrics["guard/nonfinite_tensor"] == "optimizer_update"
    message = next(msg for kind, msg, _ in metrics["_events"] if kind == "skipped_step")
    assert f"parameter {trainer.param_names[seen['first']]};" in message
    _assert_same(before, _snapshot(trainer))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_nonfinite_master_update_is_undone_before_the_model_is_written(make_trainer):
    """fp32 masters: a NaN update (eps 0 and a zero gradient: 0/0) is caught on the masters;
    masters, fp16 weights and fp32 optimizer state stay bitwise as they were."""
    trainer = make_trainer("precision.dtype=fp16", "optim.grad_clip=null")
    trainer.train_step()
    trainer.optimizer.param_groups[0]["eps"] = 0.0
    trainer.hooks["grad"].append(lambda step, g: torch.zeros_like(g) if step == 2 else g)
    for st in trainer.optimizer.state.values():
        st["exp_avg_sq"].zero_()  # so the zero gradient gives v = 0 and m/sqrt(v) = 0/0 there
        st["exp_avg"].zero_()
    before = _snapshot(trainer)
    metrics = trainer.train_step()
    assert metrics["guard/nonfinite_tensor"] == "optimizer_update"
    assert trainer.param_names[0] in next(msg for kind, msg, _ in metrics["_events"] if kind == "skipped_step")
    _assert_same(before, _snapshot(trainer))


def test_checkpoint_with_nonfinite_weights_is_refused(make_trainer):
    trainer = make_trainer()
    trainer.train_step()
    good = trainer.save_checkpoint()
    trainer.step += 1
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("nan")
    assert trainer.save_checkpoint() == good
    assert trainer.checkpoints.latest() == good
    assert "non-finite weights" in trainer.refused_checkpoint
