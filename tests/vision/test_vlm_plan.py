"""The memory plan of a vision-language model (issue 47): ``portarl plan`` counts the vision
tower (its parameters exactly, as the real model has them, and how many train under
``model.freeze_vision`` / ``model.train_projector`` / ``model.lora``), the image tokens
(the longest prompt is what the trainer's codec encodes with the model) and the pixel
buffers (what the processor really makes for the data's largest prompt), for a built-in
tiny model and a saved directory; the trainer's start-up line has a plan too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from portarl.cli import main
from portarl.trainer.config import TrainConfig
from portarl.trainer.memory.arch import arch_of, prompt_stats
from portarl.trainer.memory.plan import estimate, estimate_for_config
from portarl.trainer.memory.vision import ImageStats
from portarl.vision.models import build_tiny_vlm, save_vlm

Image = pytest.importorskip("PIL.Image")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm-colours.yaml"
QUESTION = {"type": "text", "text": "Which colour is the square?"}


def _count(module, trainable_only=False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3-vl")
    model, processor = build_tiny_vlm("tiny-qwen3-vl", seed=1)
    save_vlm(model, processor, directory)
    return directory


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory):
    """Rows whose images differ in size and number: the longest prompt and the most pixels
    are not every row's (the colours example's images are all 56 x 56)."""
    root = tmp_path_factory.mktemp("mixed")
    sizes = [[(56, 56)], [(112, 112)], [(56, 84), (84, 140)], []]
    rows = []
    for i, images in enumerate(sizes):
        names = []
        for j, size in enumerate(images):
            names.append(f"img_{i}_{j}.png")
            Image.new("RGB", size, "red").save(root / names[-1])
        content = [{"type": "image"} for _ in images] + [QUESTION]
        rows.append({"prompt": [{"role": "user", "content": content}], "images": names, "answer": "red"})
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(*sets) -> TrainConfig:
    return TrainConfig.load(str(EXAMPLE), list(sets))


def test_plan_of_the_colours_example_names_the_tower_the_image_tokens_and_the_pixels(capsys):
    assert main(["plan", "--config", str(EXAMPLE), "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    model, _ = build_tiny_vlm("tiny-qwen2.5-vl")
    assert f"vision tower: {_count(model.model.visual):,} parameters" in out, out
    for line in ("vision tower weights", "vision tower optimizer state", "vision tower gradients", "image tokens",
                 "pixel buffers (micro-batch)", "pixel buffers (rollout)"):
        assert line in out, (line, out)
    assert "fits" in out and "unavailable" not in out
    assert main(["plan", "--device-memory", "80GiB"]) == 0  # a text model: none of it
    text = capsys.readouterr().out
    assert "vision" not in text and "pixel" not in text and "image" not in text


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "directory"])
def test_the_towers_parameters_are_the_real_models(name, qwen3_dir):
    path = str(qwen3_dir) if name == "directory" else name
    arch = arch_of(TrainConfig.load(None, [f"model.path={path}"]).model)
    model, _ = build_tiny_vlm("tiny-qwen3-vl" if name == "directory" else name, seed=1)
    assert arch.vision_params == _count(model.model.visual)
    assert arch.params + arch.vision_params == _count(model)  # the language model from text_config, exactly


@pytest.mark.parametrize("sets", [[], ["model.train_projector=true"], ["model.freeze_vision=false"],
                                  ["model.freeze_vision=false", "model.lora.r=4"]])
def test_the_trainable_count_follows_freeze_vision_and_train_projector(sets, qwen3_dir):
    """The plan's trainable parameters are those the built model leaves trainable."""
    from portarl.assets.models import build_model

    if any("lora" in s for s in sets):
        pytest.importorskip("peft")
    cfg = _config(f"model.path={qwen3_dir}", "model.train_projector=false", *sets)
    plan = estimate_for_config(cfg)
    model, _ = build_model(cfg.model)
    tower = model.model.visual
    if cfg.model.lora is not None:
        from portarl.assets.lora import apply_lora

        model = apply_lora(model, cfg.model.lora)
    assert plan.trainable == _count(model, trainable_only=True)
    tower_trains = _count(tower, trainable_only=True)
    assert plan.arch.vision.trainable(cfg.model) == tower_trains
    assert plan.parts["vision tower optimizer state"] == 2 * 4 * tower_trains  # fp32 AdamW moments
    assert plan.parts["vision tower gradients"] == 4 * tower_trains
    assert plan.parts["vision tower weights"] == 4 * _count(tower)
    expected = {0: 0, _count(tower.merger) + _count(tower.deepstack_merger_list): 1, _count(tower): 2}
    assert expected[tower_trains] == (0 if not sets or cfg.model.lora else 1 if cfg.model.freeze_vision else 2)


def test_tower_activations_follow_what_trains():
    arch = arch_of(_config().model)

    def saved(*sets):
        cfg = _config("train.gradient_checkpointing=false", "model.train_projector=false", *sets)
        return estimate(cfg, arch, prompt_tokens=20, images=ImageStats(16, 4, 0)).parts["vision tower activations"]

    frozen, projector, whole = saved(), saved("model.train_projector=true"), saved("model.freeze_vision=false")
    assert frozen == 0 < projector < whole
    assert saved("model.freeze_vision=false", "train.micro_batch_size=2") * 32 == whole  # per row of the micro-batch
    # checkpointed: every block keeps its input, one recomputes (and the input gradients reach a frozen tower)
    assert 0 < saved("train.gradient_checkpointing=true") < whole


@pytest.mark.parametrize("model_path", ["tiny-qwen2.5-vl", "qwen3 directory"])
def test_prompts_and_pixel_buffers_are_what_the_model_and_its_processor_make(model_path, qwen3_dir, mixed_data):
    from portarl.assets.data import load_examples_for
    from portarl.assets.models import build_model
    from portarl.vision.codec import codec_for

    path = str(qwen3_dir) if model_path.endswith("directory") else model_path
    cfg = _config(f"model.path={path}", f"data.path={mixed_data}", "model.max_pixels=6272")
    model, processor = build_model(cfg.model)
    codec = codec_for(processor, model)  # the trainer's: M-RoPE positions from the model
    examples = load_examples_for(cfg.data)
    encoded = [codec.encode_example(ex) for ex in examples]
    pixels = [codec.pixel_values(ex) for ex in examples]
    largest = max(p.numel() * 4 for p in pixels if p is not None)
    stats = prompt_stats(cfg)
    assert stats.longest == max(len(ids) for ids in encoded)
    assert stats.tokens == sum(len(ids) for ids in encoded) and stats.examples == len(examples) == 4
    assert stats.images.image_tokens == max(ids.count(codec.image_token_id) for ids in encoded) > 0
    plan = estimate_for_config(cfg)
    assert plan.micro_batch_rows > 1
    assert plan.parts["pixel buffers (micro-batch)"] == plan.micro_batch_rows * largest
    rollout_rows = cfg.train.prompts_per_step * cfg.rollout.group_size  # one decode chunk: all of them
    assert plan.parts["pixel buffers (rollout)"] == rollout_rows * largest
    assert plan.parts["pixel cache (host)"] == sum(p.numel() * 4 for p in pixels if p is not None)
    assert largest != min(p.numel() * 4 for p in pixels if p is not None)  # the largest prompt was picked out


def test_the_trainers_start_line_has_a_plan_for_a_vlm(tmp_path, capsys):
    args = ["train", "--config", str(EXAMPLE), "--output-dir", str(tmp_path / "run"), "--set", "train.steps=2",
            "--set", "train.sft_warmup_steps=2", "--set", "train.prompts_per_step=2", "--set", "rollout.group_size=2",
            "--set", "eval.every=2", "--set", "eval.max_prompts=2"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "portarl train: memory plan: estimated peak" in err and "memory plan unavailable" not in err, err
