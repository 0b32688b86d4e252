"""Every algorithm and layout portarl has, on both tiny MoE families, with routing replay
(issue 48: "trained with every algorithm and layout portarl has").

One step each, kept cheap by a covering design rather than the full product: per family,
every registered policy loss runs once, the advantage estimators, the three micro-batch
layouts (padded, padding-free, shared-prompt), both replay modes (R3 ``rollout``, R2
``old`` with two mini-batches so that the update replays after the policy moved) and the
loss aggregations cycle through the cases, shifted between the families so the pairs
differ. A test fails when a name is registered that no case runs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

import run_guard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

from portarl.assets.data import arithmetic_examples  # noqa: E402
from portarl.core import ADVANTAGE_ESTIMATORS, POLICY_LOSSES  # noqa: E402
from portarl.moe.models import BUILTIN_MOES, build_tiny_moe  # noqa: E402
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL  # noqa: E402
from portarl.trainer import GRPOTrainer  # noqa: E402
from trainer_fast import fast_config, varied_reward  # noqa: E402

LOSSES = ["ppo_clip", "gspo", "reinforce", "cispo", "sapo"]
ESTIMATORS = ["grpo", "rloo", "reinforce_pp"]
LAYOUTS = {"padded": ["train.padding_free=false"],
           "padding-free": ["train.padding_free=true", "train.share_prompt=false"],
           "shared-prompt": ["train.padding_free=true", "train.share_prompt=true"]}
REPLAYS = {"rollout": [], "old": ["train.mini_batches=2", "loss.kl_coef=0.01"]}
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def _cases():
    for shift, name in enumerate(BUILTIN_MOES):
        for i, loss in enumerate(LOSSES):
            j = i + shift
            yield pytest.param(name, loss, ESTIMATORS[j % 3], list(LAYOUTS)[(j + shift) % 3], list(REPLAYS)[j % 2],
                               AGGREGATIONS[(i + 2 * shift) % 3], id=f"{name}-{loss}")


CASES = list(_cases())


def test_the_cases_cover_every_registered_name_and_layout():
    assert set(LOSSES) == set(POLICY_LOSSES.names()) and set(ESTIMATORS) == set(ADVANTAGE_ESTIMATORS.names())
    for name in BUILTIN_MOES:
        mine = [c.values for c in CASES if c.values[0] == name]
        for position, values in ((1, LOSSES), (2, ESTIMATORS), (3, LAYOUTS), (4, REPLAYS)):
            assert {c[position] for c in mine} == set(values), (name, position)


@pytest.mark.compares_runs
@pytest.mark.parametrize("name, loss, estimator, layout, replay, aggregation", CASES)
def test_an_moe_model_trains_one_step(tmp_path, name, loss, estimator, layout, replay, aggregation):
    model, tokenizer = build_tiny_moe(name, seed=3)
    cfg = fast_config(tmp_path, "train.steps=1", "rollout.max_new_tokens=5", f"rollout.routing_replay={replay}",
                      f"loss.policy_loss={loss}", f"loss.advantage_estimator={estimator}",
                      f"loss.loss_agg_mode={aggregation}", *LAYOUTS[layout], *REPLAYS[replay])
    trainer = GRPOTrainer(model, tokenizer, [varied_reward], arithmetic_examples(16, seed=0), cfg, device="cpu")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert metrics["skipped"] == 0 and math.isfinite(metrics["loss"])
    assert metrics["update/applied_steps"] == (2 if replay == "old" else 1)
    # the step trained (R2 "old": its second optimizer step replayed the recorded routes after the policy moved)
    run_guard.assert_trained([metrics["grad_norm"]], before, dict(trainer.model.named_parameters()),
                             what=f"{name} {loss} {layout} replay={replay}")
    assert 0.0 < metrics["rollout/routing_agreement"] <= 1.0
    assert "moe/load_imbalance" in metrics
    if replay == "rollout":  # the engine's own log-probs, replayed by the trainer at staleness 0
        assert metrics["mismatch/abs_diff_max"] <= ROLLOUT_FP32_ATOL, metrics["mismatch/abs_diff_max"]

