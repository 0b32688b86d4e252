"""NaN in old_logp, a reward or a gradient: the step is skipped, weights and optimizer
state are bitwise unchanged, the metric counts it, the run goes on; a persistent NaN stops
the run with a checkpoint naming the tensor."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from portarl.trainer import TrainingStopped
from portarl.trainer.checkpoint import CheckpointManager
from portarl.trainer.guards.detectors import DegenerateDetector, SpikeDetector, is_degenerate
from trainer_fast import varied_reward


def _nan_at(step_to_poison, *, where=None):
    def hook(step, tensor):
        if step == step_to_poison:
            tensor = tensor.clone()
            if where is None:
                tensor.view(-1)[0] = float("nan")
            else:
                tensor[where] = float("nan")
        return tensor

    return hook


def _snapshot(trainer):
    return (
        {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        copy.deepcopy(trainer.optimizer.state_dict()),
    )


def _assert_same(a, b):
    params_a, opt_a = a
    params_b, opt_b = b
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name
    assert opt_a["param_groups"] == opt_b["param_groups"]
    for key in opt_a["state"]:
        for field, value in opt_a["state"][key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b["state"][key][field])), (key, field)


@pytest.mark.parametrize("point", ["old_logp", "reward", "grad", "advantage", "loss"])
def test_nan_mid_run_skips_that_step_only(make_trainer, point):
    trainer = make_trainer("loss.kl_coef=0.01", rewards=[varied_reward])  # a gradient from step 1 on
    trainer.hooks[point].append(_nan_at(2))
    first = trainer.train_step()
    assert first["skipped"] == 0
    before = _snapshot(trainer)
    second = trainer.train_step()
    assert second["skipped"] == 1
    assert second["guard/nonfinite_tensor"] == {"grad": "gradient"}.get(point, point)
    assert second["guard/skipped_total"] == 1
    assert any(kind == "skipped_step" for kind, _, _ in second["_events"])
    _assert_same(before, _snapshot(trainer))
    third = trainer.train_step()
    assert third["skipped"] == 0 and third["guard/consecutive_skips"] == 0
    assert not torch.equal(before[0]["model.embed_tokens.weight"], trainer.model.get_input_embeddings().weight)


def test_nan_logits_are_named(make_trainer):
    """A model that emits NaN logits: the skip names the logits, not just old_logp."""
    trainer = make_trainer()
    with torch.no_grad():
        trainer.model.get_input_embeddings().weight[5:] = float("nan")  # every character token
    metrics = trainer.train_step()
    assert metrics["skipped"] == 1 and metrics["guard/nonfinite_tensor"] == "logits"


def test_nan_in_ref_logp_is_named(make_trainer):
    trainer = make_trainer("loss.kl_coef=0.01")
    trainer.ref_model = trainer.make_reference()
    trainer.hooks["ref_logp"].append(_nan_at(1))
    assert trainer.train_step()["guard/nonfinite_tensor"] == "ref_logp"


def test_persistent_nan_stops_with_checkpoint_and_named_tensor(make_trainer):
    trainer = make_trainer("train.steps=10", "guards.max_consecutive_skips=3")
    trainer.hooks["old_logp"].append(lambda step, t: t + float("nan") if step >= 2 else t)
    with pytest.raises(TrainingStopped, match="first non-finite tensor was old_logp") as err:
        trainer.train()
    assert err.value.tensor_name == "old_logp"
    latest = CheckpointManager(trainer.output_dir).latest()
    assert latest is not None and latest == err.value.checkpoint and (latest / "COMPLETE").exists()
    assert CheckpointManager.load_state(latest)["step"] == 4  # steps 2, 3, 4 skipped
    events = [json.loads(line) for line in (trainer.output_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["kind"] == "stopped"


def test_request_stop_finishes_the_step_then_checkpoints(make_trainer):
    trainer = make_trainer("train.steps=10", "checkpoint.every=100")

    def stop_at_3(step, tensor):
        if step == 3:
            trainer.request_stop()
        return tensor

    trainer.hooks["reward"].append(stop_at_3)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    latest = CheckpointManager(trainer.output_dir).latest()
    assert latest.name == "step-000003"


def test_spike_detector():
    det = SpikeDetector("kl", window=10, min_history=5, factor=6.0)
    for v in [0.010, 0.012, 0.011, 0.009, 0.010, 0.011]:
        assert det.update(v) is None
    event = det.update(0.5)
    assert event is not None and event["kind"] == "kl_spike" and event["value"] == 0.5
    assert det.update(float("nan")) is None  # not a spike, not history


def test_degenerate_detector():
    bang = 7
    assert is_degenerate([bang] * 8, eos_token_id=2, min_tokens=4)
    assert is_degenerate([bang] * 4 + [2], eos_token_id=2, min_tokens=4)
    assert not is_degenerate([bang, bang, 2], eos_token_id=2, min_tokens=4)
    assert not is_degenerate([5, 6, 5, 6], eos_token_id=2, min_tokens=4)
    det = DegenerateDetector(eos_token_id=2, min_tokens=4, rise=0.25)
    normal = [[5, 6, 2]] * 8
    for _ in range(3):
        frac, event = det.update(normal)
        assert frac == 0.0 and event is None
    frac, event = det.update([[bang] * 8] * 4 + normal[:4])
    assert frac == 0.5 and event["kind"] == "degenerate_rise"


def test_all_finite_flags_exactly_what_is_not_finite():
    """The post-step check (a foreach 2-norm, rechecked exactly where the norm overflows):
    NaN / +inf / -inf are caught in any dtype; finite tensors whose 2-norm overflows (fp32
    values ~1e30, fp16 values whose norm passes 65504) are not flagged."""
    from portarl.trainer.guards.step_guard import _all_finite

    def poisoned(value, dtype=torch.float32):
        t = torch.ones(1000, dtype=dtype)
        t[517] = value
        return t

    tensors = [torch.full((64,), 1e30), torch.full((1000,), 300.0, dtype=torch.float16), torch.empty(0),
               poisoned(float("nan")), poisoned(float("inf")), poisoned(float("-inf"), torch.bfloat16),
               poisoned(float("nan"), torch.float16), torch.randn(33, 7)]
    assert _all_finite(tensors) == [True, True, True, False, False, False, False, True]
