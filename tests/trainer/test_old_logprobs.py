"""train.old_logprobs=auto: on-policy (one optimizer step per rollout, the engine sampled the
trainer's current weights) the no-grad scoring forward is skipped and the update takes the
old log-probs from its own forward; loss, grad norm and every metric (mismatch metrics
included) equal the ``recompute`` path within fp32 tolerance. Wherever the numbers could
differ, the forward still runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

import run_guard
from portarl.parity.tolerances import fp32_result
from portarl.rollout import RecordingRollout, ReplayRollout
from portarl.trainer.phases import scoring
from trainer_fast import varied_reward

#: One micro-batch per step (4 prompts x 4 samples), so the saved forward is one model call.
ONE_MB = "train.micro_batch_size=16"


def _decoder_calls(trainer) -> list[int]:
    calls = [0]
    trainer.model.get_decoder().register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    return calls


def _scoring_forwards(monkeypatch) -> list:
    """Models that scoring.no_grad_logprobs ran, in call order."""
    seen = []
    real = scoring.no_grad_logprobs

    def spy(trainer, model, batch, *rest):
        seen.append(model)
        return real(trainer, model, batch, *rest)

    monkeypatch.setattr(scoring, "no_grad_logprobs", spy)
    return seen


def test_auto_saves_one_forward_per_step(make_trainer):
    counts = {}
    for mode in ("recompute", "auto"):
        trainer = make_trainer(ONE_MB, f"train.old_logprobs={mode}", rewards=[varied_reward])
        calls = _decoder_calls(trainer)
        trainer.train_step()
        counts[mode] = calls[0]
    assert counts["auto"] == counts["recompute"] - 1, counts


@pytest.mark.compares_runs
def test_auto_equals_recompute_within_fp32(make_trainer):
    """Two steps, KL to a reference, mismatch correction (the default token_truncate): the same metrics and weights."""
    runs = {}
    for mode in ("recompute", "auto"):
        trainer = make_trainer(f"train.old_logprobs={mode}", "loss.kl_coef=0.01",
                               rewards=[varied_reward])
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        rows = [trainer.train_step() for _ in range(2)]
        runs[mode] = rows, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        run_guard.assert_trained([r["grad_norm"] for r in rows], start, runs[mode][1], what=f"old_logprobs={mode}")
    (want_rows, want_params), (got_rows, got_params) = runs["recompute"], runs["auto"]
    for want, got in zip(want_rows, got_rows):
        assert want["skipped"] == got["skipped"] == 0
        keys = {k for k in want if not k.startswith("time/") and k != "_events"}
        assert keys == {k for k in got if not k.startswith("time/") and k != "_events"}
        assert any(k.startswith("mismatch/") for k in keys), sorted(keys)
        for key in sorted(keys):
            a, b = want[key], got[key]
            if isinstance(a, str) or a is None:
                assert a == b, key
                continue
            if math.isnan(a):
                assert math.isnan(b), key
                continue
            assert abs(a - b) <= fp32_result(abs(a)).atol, f"{key}: recompute {a!r} vs auto {b!r}"
    for name, p in want_params.items():
        assert (got_params[name] - p).abs().max() <= fp32_result(float(p.abs().max())).atol, name


@pytest.mark.parametrize("setting", ["train.ppo_epochs=2", "train.mini_batches=2", "loss.kl_in_reward=true",
                                     "train.old_logprobs=recompute", "precision.numerics=npu-emulated"])
def test_forward_still_runs_when_numbers_could_differ(make_trainer, monkeypatch, setting):
    seen = _scoring_forwards(monkeypatch)
    trainer = make_trainer(setting, "loss.kl_coef=0.01", rewards=[varied_reward])
    assert scoring.old_logprobs_recompute_reason(trainer) is not None
    trainer.train_step()
    assert any(m is trainer.model for m in seen)


def test_replayed_rollouts_keep_the_forward_recorded_ones_do_not(make_trainer, monkeypatch):
    seen = _scoring_forwards(monkeypatch)
    recorder = make_trainer(rewards=[varied_reward])
    recorder.rollout = RecordingRollout(recorder.rollout)  # wraps the hf engine: still the trainer's policy
    recorder.train_step()
    assert not any(m is recorder.model for m in seen)

    replayer = make_trainer(rewards=[varied_reward])
    replayer.rollout = ReplayRollout(recorder.rollout.batches)
    assert "replay engine" in scoring.old_logprobs_recompute_reason(replayer)
    replayer.train_step()
    assert any(m is replayer.model for m in seen)


def test_engine_with_stale_or_foreign_weights_keeps_the_forward(make_trainer):
    """A copy-holding engine (vLLM's bookkeeping): synced from the trainer's model and no
    optimizer step since -> reuse; stale or synced from another model -> recompute."""
    from portarl.rollout import vllm_sync
    from portarl.rollout.vllm import VLLMRollout

    trainer = make_trainer()
    engine = VLLMRollout.__new__(VLLMRollout)  # the version bookkeeping only; no vLLM needed
    engine.weights_version = engine.trainer_version = 0
    engine.sync_path = vllm_sync.RELOAD  # what start-up chooses for a worker with reload_weights
    engine.wake_up = lambda: None
    engine.llm = type("LLM", (), {"collective_rpc": lambda *a, **k: None, "reset_prefix_cache": lambda self: None})()
    trainer.rollout = engine
    assert scoring.old_logprobs_recompute_reason(trainer) is not None  # never synced
    engine.sync_weights(trainer.model)
    assert scoring.old_logprobs_recompute_reason(trainer) is None
    engine.mark_trainer_updated()
    assert "did not sample" in scoring.old_logprobs_recompute_reason(trainer)
    engine.sync_weights(torch.nn.Linear(2, 2))
    assert scoring.old_logprobs_recompute_reason(trainer) is not None


def test_nan_old_logp_from_the_training_forward_is_guarded_before_backward(make_trainer):
    """The old_logp hook and guard apply to the detached training forward: the step is
    skipped, named old_logp, and no gradient was applied."""
    trainer = make_trainer(rewards=[varied_reward])
    assert scoring.old_logprobs_recompute_reason(trainer) is None
    shapes = []

    def poison(step, t):
        shapes.append(tuple(t.shape))
        assert not t.requires_grad
        return t + float("nan")

    trainer.hooks["old_logp"].append(poison)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step()
    assert metrics["skipped"] == 1 and metrics["guard/nonfinite_tensor"] == "old_logp"
    assert shapes and shapes[0][0] == 8  # one micro-batch (train.micro_batch_size=8)
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_nan_logits_are_named_when_old_logp_comes_from_the_training_forward(make_trainer):
    trainer = make_trainer("loss.kl_coef=0")  # no reference forward in scoring to find them first
    assert scoring.old_logprobs_recompute_reason(trainer) is None
    with torch.no_grad():
        trainer.model.get_input_embeddings().weight[5:] = float("nan")
    metrics = trainer.train_step()
    assert metrics["skipped"] == 1 and metrics["guard/nonfinite_tensor"] == "logits"


def _train_async(tmp_path, monkeypatch, *overrides: str) -> tuple[list[dict], dict, int]:
    """An async run (rollout.max_staleness 1: stale batches from step 2 on) with a reward
    that varies within groups; its metrics rows, final weights and the trainer's model
    calls (the worker's are its own process's). The guard (tests/run_guard.py) holds it to
    have trained."""
    import os
    from pathlib import Path

    from portarl.trainer import GRPOTrainer, build_from_config
    from trainer_fast import fast_config

    here = Path(__file__).parent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    cfg = fast_config(tmp_path, "rollout.mode=async", ONE_MB, "rewards=[{name: 'trainer_fast:varied_reward'}]",
                      *overrides)
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    calls = _decoder_calls(trainer)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    end = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run_guard.assert_trained([r["grad_norm"] for r in rows], start, end, what=f"async run {overrides}")
    return rows, end, calls[0]


@pytest.mark.compares_runs
def test_async_takes_the_proximal_logprobs_from_the_training_forward(tmp_path, monkeypatch):
    """Decoupled PPO with one optimizer step per batch: the old (proximal) log-probs are the
    current policy's, so the training forward's own, detached, serve; loss, gradient norm,
    every metric (the mismatch ones measure staleness) and the weights equal those of the
    recompute forward within fp32 tolerance, and that forward is not run (one model call
    per step fewer)."""
    runs = {mode: _train_async(tmp_path / mode, monkeypatch, f"train.old_logprobs={mode}")
            for mode in ("recompute", "auto")}
    (want_rows, want_params, want_calls), (got_rows, got_params, got_calls) = runs["recompute"], runs["auto"]
    # one micro-batch per step: training + reference (+ the recompute) forwards
    assert (want_calls, got_calls) == (3 * len(want_rows), 2 * len(want_rows))
    assert [r["rollout/staleness_max"] for r in got_rows] == [0, 1, 1]
    for want, got in zip(want_rows, got_rows, strict=True):
        assert want["skipped"] == got["skipped"] == 0
        for key in ("loss", "pg/loss", "grad_norm", "entropy", "mismatch/abs_diff_max", "mismatch/kl_k3",
                    "reward/mean"):
            a, b = want[key], got[key]
            assert abs(a - b) <= fp32_result(abs(a)).atol, f"step {want['step']} {key}: recompute {a!r} vs auto {b!r}"
    for name, p in want_params.items():
        assert (got_params[name] - p).abs().max() <= fp32_result(float(p.abs().max())).atol, name


@pytest.mark.parametrize("setting", ["train.ppo_epochs=2", "train.mini_batches=2"])
def test_async_keeps_the_forward_for_several_optimizer_steps(make_trainer, setting):
    """With mini-batches or PPO epochs the later optimizer steps need the pre-update policy:
    the no-grad forward stays; one step per batch needs none."""
    assert scoring.old_logprobs_recompute_reason(make_trainer("rollout.mode=async")) is None
    assert "several optimizer steps" in scoring.old_logprobs_recompute_reason(make_trainer("rollout.mode=async", setting))
