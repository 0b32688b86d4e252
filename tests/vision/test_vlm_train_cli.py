"""Vision-language GRPO from the command line (issue 47): a tiny Qwen2.5-VL and a tiny
Qwen3-VL, built from a config and saved with their processors, train 2 steps (warm-up
included) on the colours example's images through the real loading path
(``AutoProcessor`` / ``AutoModelForImageTextToText``), padded and padding-free; the run
resumes as the uninterrupted run; ``portarl export`` writes a directory that loads again
with its processor. Runs that cannot work yet are refused at start with the setting to
change; image rows for a text model are refused naming the row.

The runs train (issue 58): the colours reward gives 0 to a model that has had 2 warm-up
steps, so every advantage, gradient and update was 0 and "trains" and "resumes" held for
weights that never moved. Here the runs that claim training score with a reward that
differs within groups (``trainer_fast.varied_reward``) and pass through the guard
(tests/run_guard.py): some GRPO step's grad_norm > 0 and the weights moved."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import run_guard
from portarl.cli import main
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL
from portarl.vision.models import build_tiny_vlm, load_vlm, save_vlm

pytest.importorskip("PIL.Image")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm-colours.yaml"
TRAINER_TESTS = Path(__file__).resolve().parents[1] / "trainer"
#: A reward with spread within every group from the first step (the colours reward is 0 for
#: every sample of a model with a 2-step warm-up: zero advantages, zero gradient).
SPREAD = ["--set", "rewards=[{name: 'trainer_fast:varied_reward'}]"]
SHORT = ["--set", "train.steps=2", "--set", "train.sft_warmup_steps=2", "--set", "train.prompts_per_step=2",
         "--set", "rollout.group_size=2", "--set", "eval.every=2", "--set", "eval.max_prompts=2",
         "--set", "checkpoint.every=1"]


@pytest.fixture(scope="module", params=["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model, processor = build_tiny_vlm(request.param, seed=2)
    save_vlm(model, processor, directory)
    return directory


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def spread_reward(monkeypatch):
    """``trainer_fast:varied_reward`` importable here and in an async worker process."""
    monkeypatch.syspath_prepend(str(TRAINER_TESTS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TRAINER_TESTS), os.environ.get("PYTHONPATH", "")]))
    return SPREAD


@pytest.mark.compares_runs
@pytest.mark.parametrize("padding_free", ["auto", "false"])
def test_a_saved_vlm_trains_resumes_and_exports_from_the_command_line(model_dir, tmp_path, padding_free,
                                                                       spread_reward):
    """Two steps train (the guard), a resume to step 3 moves the weights again and ends where
    a 3-step run ends, bitwise. Tried once by hand against a broken resume (the optimizer's
    state not restored: ``persistence.resume`` skipping ``optimizer.load_state_dict``): this
    test fails at the resumed run's weights (32 tensors differ from the 3-step run's), while
    the earlier version, whose steps all had grad_norm 0.0, passed."""
    run, whole = tmp_path / "run", tmp_path / "whole"

    def args(out: Path) -> list[str]:
        return ["train", "--config", str(EXAMPLE), "--output-dir", str(out), "--set", f"model.path={model_dir}",
                "--set", f"train.padding_free={padding_free}", *SHORT, *spread_reward]

    assert main(args(run)) == 0
    rows = [m for m in _metrics(run) if m.get("phase") == "grpo"]
    assert [m["step"] for m in rows] == [1, 2]
    run_guard.assert_run_trained(run, what=f"{model_dir.name} trained 2 steps")
    second = run_guard.checkpoint_weights(run)
    assert main([*args(run), "--steps", "3", "--resume"]) == 0
    assert max(m["step"] for m in _metrics(run) if m.get("phase") == "grpo") == 3
    run_guard.assert_trained(run_guard.grad_norms(run)[2:], second, run_guard.checkpoint_weights(run),
                             what="the resumed step")
    assert main([*args(whole), "--steps", "3"]) == 0
    resumed, uninterrupted = run_guard.checkpoint_weights(run), run_guard.checkpoint_weights(whole)
    assert [k for k in uninterrupted if not torch.equal(resumed[k], uninterrupted[k])] == []
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    model, processor = load_vlm(out)
    assert type(processor).__name__.endswith("Processor") and processor.image_processor is not None
    exported = model.state_dict()
    assert any(torch.equal(exported[k], resumed[k]) for k in resumed if k in exported), "the trained weights"


@pytest.mark.compares_runs
@pytest.mark.parametrize("sync", ["collective", "file"])
def test_async_rollout_sends_the_frozen_tower_once_and_matches_its_log_probs(tmp_path, monkeypatch, sync,
                                                                              spread_reward):
    """rollout.mode=async: the worker process encodes the same prompts, samples with the
    pixels, and loads the frozen vision tower with the first weights version only; the
    versions after it carry trained weights (the guard)."""
    from portarl.trainer.asynchronous import pipeline

    sent = []
    original = pipeline.rollout_tensors

    def spy(*args, **kwargs):
        names = []
        sent.append(names)
        for name, tensor in original(*args, **kwargs):
            names.append(name)
            yield name, tensor

    def spy_state(*args, **kwargs):
        state = original_state(*args, **kwargs)
        sent.append(sorted(state or ()))
        return state

    original_state = pipeline.rollout_state_dict
    monkeypatch.setattr(pipeline, "rollout_tensors", spy)
    monkeypatch.setattr(pipeline, "rollout_state_dict", spy_state)
    run = tmp_path / "run"
    args = ["train", "--config", str(EXAMPLE), "--output-dir", str(run), "--set", "rollout.mode=async",
            "--set", f"rollout.weight_sync={sync}", "--set", "train.old_logprobs=recompute", *SHORT, "--set", "train.steps=3",
            *spread_reward]
    assert main(args) == 0
    rows = [m for m in _metrics(run) if m.get("phase") == "grpo"]
    assert [m["step"] for m in rows] == [1, 2, 3]
    run_guard.assert_run_trained(run, what=f"async VLM run, {sync} sync")
    tower = {n for n in sent[0] if n.startswith("model.visual.") and not n.startswith("model.visual.merger.")}
    projector = {n for n in sent[0] if n.startswith("model.visual.merger.")}  # trains: train_projector in the example
    assert tower and projector, "the first version carries the whole vision tower"
    assert len(sent) >= 2 and all(projector <= set(names) and not tower & set(names) for names in sent[1:])
    # the worker sampled what the trainer's policy scores (staleness 0 at step 1: the same weights)
    first = rows[0]
    assert first["mismatch/abs_diff_max"] <= ROLLOUT_FP32_ATOL, first


def test_dynamic_sampling_rounds_carry_the_pixels(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--config", str(EXAMPLE), "--output-dir", str(run), *SHORT,
                 "--set", "rollout.dynamic_sampling=true", "--set", "rollout.max_generation_rounds=2",
                 "--set", "train.sft_warmup_steps=40"]) == 0
    assert [m["step"] for m in _metrics(run) if m.get("phase") == "grpo"] == [1, 2]


def test_what_is_not_wired_yet_is_refused_at_start_naming_the_setting(tmp_path, capsys):
    args = ["train", "--config", str(EXAMPLE), "--output-dir", str(tmp_path / "r"), *SHORT]
    assert main([*args, "--set", "tools=[calculator:multiply]"]) == 2
    assert "with a vision-language model" in capsys.readouterr().err


def test_image_rows_for_a_text_model_are_refused_naming_the_row(tmp_path, capsys):
    args = ["train", "--config", str(EXAMPLE), "--output-dir", str(tmp_path / "r"), "--set", "model.path=tiny-chat",
            *SHORT]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "vlm_colours.jsonl:1" in err and "vision-language" in err


@pytest.mark.compares_runs
def test_lora_adapts_the_language_model_only_and_trains_from_the_command_line(tmp_path, spread_reward):
    pytest.importorskip("peft")
    from portarl.assets.lora import apply_lora, _lora_layers
    from portarl.trainer.config.lora import lora_section

    model, _ = build_tiny_vlm("tiny-qwen2.5-vl")
    wrapped = apply_lora(model, lora_section({"r": 4}))
    names = [name for name, _ in _lora_layers(wrapped)]
    assert names and not any(".visual." in n for n in names)
    assert any("mlp.down_proj" in n for n in names)  # the language model's MLP is adapted
    run = tmp_path / "run"
    assert main(["train", "--config", str(EXAMPLE), "--output-dir", str(run), "--set", "model.lora.r=4", *SHORT,
                 *spread_reward]) == 0
    assert [m["step"] for m in _metrics(run) if m.get("phase") == "grpo"] == [1, 2]
    moved = run_guard.assert_run_trained(run, what="a LoRA VLM run")
    assert moved and all("lora_" in name for name in moved), moved  # the adapter trains, nothing else


def test_on_policy_the_sequence_mean_loss_is_zero_with_a_gradient(tmp_path):
    """On-policy (one optimizer step per rollout: the old log-probs are the training forward's),
    each sequence's clipped ratio is 1 and group-normalised advantages sum to zero per group,
    so seq-mean-token-mean's policy loss is 0 while its gradient is not: as for text, with the
    vision tower's features in every forward."""
    run = tmp_path / "run"
    assert main(["train", "--config", str(EXAMPLE), "--output-dir", str(run), "--set", "train.steps=1",
                 "--set", "train.sft_warmup_steps=70", "--set", "eval.data=null",
                 "--set", "loss.loss_agg_mode=seq-mean-token-mean"]) == 0
    step = next(m for m in _metrics(run) if m.get("phase") == "grpo")
    assert 0.0 < step["reward/mean"] < 1.0, step  # rewards differ inside groups: advantages are not all zero
    assert abs(step["pg/loss"]) < 1e-6 and step["grad_norm"] > 1e-3, step


@pytest.mark.compares_runs
def test_a_saved_vlm_trains_in_async_mode(model_dir, tmp_path, spread_reward):
    """Both families from their saved directories, the rollout in a worker process."""
    run = tmp_path / "run"
    assert main(["train", "--config", str(EXAMPLE), "--output-dir", str(run), "--set", f"model.path={model_dir}",
                 "--set", "rollout.mode=async", *SHORT, *spread_reward]) == 0
    assert [m["step"] for m in _metrics(run) if m.get("phase") == "grpo"] == [1, 2]
    run_guard.assert_run_trained(run, what=f"{model_dir.name} in async mode")
