"""Mixture-of-experts GRPO under torchrun (issue 48): tiny-qwen3-moe with routing replay
(``rollout.routing_replay: rollout``) on 2 Gloo ranks (FSDP2) against 1 process on the same
global batch, with the tolerances of test_fsdp_gloo.py.

The rollout engine is made to route otherwise than the trainer on some tokens
(moe_routes_otherwise.py, loaded as the reward module in every rank), so the trainer's
log-probs equal the engine's only where each rank replays its own recorded experts through
the routers inside its FSDP units. The second test holds FSDP2's experts on their own: 4
experts sharded 2 a rank, one expert idle on one rank and busy on the other
(moe_grads_worker.py), gradients equal to one process's. The third holds the router
load-balancing loss (``loss.router_aux_coef``) to one process's: its statistics are summed
over ranks (portarl/moe/load.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

import run_guard  # noqa: E402
from test_fsdp_gloo import ATOL, FAST, RTOL, _env, _rows, assert_params_close, assert_same_step  # noqa: E402

from portarl.moe.models import build_tiny_moe  # noqa: E402
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL  # noqa: E402
from portarl.runtime.distributed import local_launcher  # noqa: E402
from portarl.trainer.checkpoint import CheckpointManager  # noqa: E402

HERE = Path(__file__).parent
MOE = "tiny-qwen3-moe"
# test_fsdp_gloo.py's run (its lr, so its PARAM_ATOL), the tiny model's own width, and the
# engine routing otherwise (the reward module). One decode path and unshared rows, as there.
SETS = [*(s for s in FAST if not s.startswith(("model.", "rewards="))), f"model.path={MOE}",
        "rollout.routing_replay=rollout", "rewards=[{name: 'moe_routes_otherwise:length_and_digits'}]",
        "train.steps=1", "rollout.lean_decode=false", "train.share_prompt=false"]


def _both(single: list[str], double: list[str]) -> None:
    """Run the 1-process and the 2-rank command side by side (independent runs) and wait for both."""
    procs = [subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for cmd in (single, double)]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]


def _train(out: Path, ranks: int, *extra: str) -> list[str]:
    launcher = [*local_launcher(ranks), "-m", "portarl"] if ranks > 1 else [sys.executable, "-m", "portarl"]
    cmd = [*launcher, "train", "--device", "cpu", "--output-dir", str(out)]
    for item in (*SETS, *extra):
        cmd += ["--set", item]
    return cmd


def _params(directory: Path | None = None) -> dict[str, torch.Tensor]:
    """Parameters of a checkpoint (sharded or not) loaded in this process; the initial ones without."""
    model, _ = build_tiny_moe(MOE, seed=0)
    if directory is not None and CheckpointManager.is_sharded(directory):
        CheckpointManager.load_sharded(directory, model, torch.optim.AdamW(model.parameters()))
    elif directory is not None:
        CheckpointManager.load_weights(model, directory)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.compares_runs
def test_one_moe_step_with_routing_replay_on_two_ranks_matches_one_process(tmp_path):
    single, double = tmp_path / "single", tmp_path / "double"
    _both(_train(single, 1), _train(double, 2))
    assert_same_step(single, double, keys=("loss", "pg/loss", "kl/loss", "grad_norm", "entropy"))
    for out in (single, double):
        row = _rows(out)[0]
        assert 0.0 < row["rollout/routing_agreement"] < 1.0, row["rollout/routing_agreement"]  # made to disagree
        # Replayed on every rank: the trainer scores the engine's tokens as the engine did.
        assert row["mismatch/abs_diff_max"] <= ROLLOUT_FP32_ATOL, (out.name, row["mismatch/abs_diff_max"])
    a, b = _rows(single)[0], _rows(double)[0]
    assert b["rollout/routing_agreement"] == pytest.approx(a["rollout/routing_agreement"], rel=RTOL, abs=ATOL)
    start = _params()
    pa, pb = _params(CheckpointManager(single).latest()), _params(CheckpointManager(double).latest())
    assert_params_close(pa, pb)
    experts = [k for k in start if ".experts." in k]
    assert experts and all(not torch.equal(pb[k], start[k]) for k in experts), "every layer's experts train"


@pytest.mark.compares_runs
def test_an_expert_idle_on_one_rank_still_gets_the_other_ranks_gradient(tmp_path):
    worker = HERE / "moe_grads_worker.py"
    single, double = tmp_path / "single", tmp_path / "double"
    single.mkdir(), double.mkdir()
    _both([sys.executable, str(worker), str(single)], [*local_launcher(2), str(worker), str(double)])
    a = safetensors.load_file(str(single / "grads.safetensors"))
    b = safetensors.load_file(str(double / "grads.safetensors"))
    assert b.keys() == {k for k in a if not k.startswith("row1.")}
    # one backward of a loss of fixed rows, no optimizer step: the gradients compared must flow
    for name, grads in (("1 process", {k: a[k] for k in b}), ("2 ranks", b)):
        run_guard.assert_gradient_flows(grads, what=f"the MoE gradients on {name}")
    experts = [k for k in b if ".experts." in k]
    assert len(experts) == 4
    for key in experts:  # expert 3: no gradient from row 1 (rank 1's), one from row 0 (rank 0's)
        assert torch.count_nonzero(a[f"row1.{key}"][3]) == 0 and torch.count_nonzero(a[key][3]) > 0, key
    for key in b:
        torch.testing.assert_close(b[key], a[key], rtol=RTOL, atol=ATOL, msg=key)


@pytest.mark.compares_runs
def test_the_router_aux_loss_on_two_ranks_is_the_loss_of_their_tokens_together(tmp_path):
    """``loss.router_aux_coef`` > 0: the Switch loss is a product of two means over the
    tokens, so each rank's own loss on its 8 rows, averaged, is not the loss of the 16 rows.
    portarl sums the statistics over ranks: 2 ranks (a micro-batch of 8 rows each) give
    the loss, gradients and weights of 1 process with the 16 rows in one micro-batch."""
    single, double = tmp_path / "single", tmp_path / "double"
    aux = "loss.router_aux_coef=0.5"
    _both(_train(single, 1, aux, "train.micro_batch_size=16"), _train(double, 2, aux, "train.micro_batch_size=8"))
    assert_same_step(single, double, keys=("loss", "pg/loss", "kl/loss", "grad_norm", "moe/aux_loss"))
    assert _rows(single)[0]["moe/aux_loss"] > 1.0  # E * sum f P: 1 only when perfectly balanced
    pa, pb = _params(CheckpointManager(single).latest()), _params(CheckpointManager(double).latest())
    assert_params_close(pa, pb)
