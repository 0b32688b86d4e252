"""The memory plan: model shapes read without weights (tiny, config.json, GGUF header) give
the real parameter counts; its parts move the way the settings say; ``portarl plan``'s
output and exit codes. Estimate-versus-measurement lives in docs/memory.md (a benchmark,
``portarl bench memory``), not here."""

from __future__ import annotations

import pytest

from portarl.cli import main
from portarl.models import build_tiny, load_gguf
from portarl.trainer.config import TrainConfig
from portarl.trainer.memory.arch import arch_of, longest_prompt
from portarl.trainer.memory.plan import estimate, layer_activation_elements, parse_size


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_tiny_shape_counts_the_real_parameters():
    cfg = TrainConfig.load(None, ["model.hidden_size=32", "model.intermediate_size=64"])
    model, _ = build_tiny(hidden_size=32, intermediate_size=64)
    assert arch_of(cfg.model).params == _count(model)


def test_hf_directory_and_gguf_header_count_the_real_parameters(tmp_path):
    model, _ = build_tiny(hidden_size=32, intermediate_size=64)
    model.config.tie_word_embeddings = False
    model.save_pretrained(tmp_path / "dir")  # untied now: a head of its own
    untied = TrainConfig.load(None, [f"model.path={tmp_path / 'dir'}"]).model
    assert arch_of(untied).params == _count(model) + model.config.vocab_size * 32
    gguf_tiny = pytest.importorskip("gguf_tiny")
    pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    gguf_tiny.write_tiny_gguf(path)
    arch = arch_of(TrainConfig.load(None, [f"model.path={path}"]).model)
    loaded, _ = load_gguf(path)
    assert arch.params == _count(loaded) and arch.layers == gguf_tiny.LAYERS


def test_parts_follow_the_settings():
    cfg = TrainConfig.load(None, ["model.path=tiny"])
    arch = arch_of(cfg.model)
    base = estimate(cfg, arch, prompt_tokens=10)
    assert base.parts["saved activations"] == arch.layers * layer_activation_elements(arch) * 4 * 64 * 14
    on = estimate(TrainConfig.load(None, ["train.gradient_checkpointing=true"]), arch, prompt_tokens=10)
    assert on.parts["saved activations"] < base.parts["saved activations"] == on.activations_other
    small = estimate(TrainConfig.load(None, ["train.max_tokens_per_micro_batch=60", "train.padding_free=false"]),
                     arch, prompt_tokens=10)
    assert not small.padding_free and small.micro_batch_rows == 4 and small.micro_batch_tokens == 56
    assert small.parts["saved activations"] * 16 == base.parts["saved activations"]
    # Padding-free, the budget bounds the packed tokens themselves: 60, not 4 x 14.
    packed = estimate(TrainConfig.load(None, ["train.max_tokens_per_micro_batch=60"]), arch, prompt_tokens=10)
    assert packed.padding_free and packed.micro_batch_tokens == 60
    assert packed.parts["saved activations"] * 64 * 14 == base.parts["saved activations"] * 60
    custom = TrainConfig.load(None, ["train.max_tokens_per_micro_batch=60", "model.attn_implementation=custom"])
    assert not estimate(custom, arch, prompt_tokens=10).padding_free
    two = estimate(cfg, arch, prompt_tokens=10, devices=2)
    assert two.parts["optimizer state"] * 2 == base.parts["optimizer state"]
    no_kl = estimate(TrainConfig.load(None, ["loss.kl_coef=0"]), arch, prompt_tokens=10)
    assert no_kl.parts["KL reference"] == 0 < base.parts["KL reference"]
    chunks = estimate(TrainConfig.load(None, ["rollout.max_batch_size=32"]), arch, prompt_tokens=10)
    assert chunks.parts["rollout KV cache"] * 4 == base.parts["rollout KV cache"]


def test_longest_prompt_is_the_trainers_encoding(tmp_path):
    from portarl.trainer import GRPOTrainer, build_from_config

    cfg = TrainConfig.load(None, ["data.max_operand=99", "data.synthetic_size=50", f"output_dir={tmp_path}"])
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    assert longest_prompt(cfg) == max(len(trainer.encoded_prompt(ex)) for ex in trainer.examples) >= len("99+99=")


def test_parse_size():
    assert parse_size("80GiB") == 80 * 2**30 and parse_size("64GB") == 64 * 10**9 and parse_size("1024") == 1024
    with pytest.raises(ValueError, match="--device-memory"):
        parse_size("lots")


def test_plan_command_says_whether_it_fits(capsys):
    assert main(["plan", "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "estimated peak" in out and "fits" in out and "saved activations" in out
    assert main(["plan", "--device-memory", "1MiB"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "change: train.gradient_checkpointing=true" in out
    assert main(["plan", "--devices", "3"]) == 2
    assert "multiple of --devices 3" in capsys.readouterr().err


def test_train_start_line_names_the_peak_and_the_device_memory():
    import torch

    from portarl.cli_plan import train_start_line
    from portarl.trainer import build_from_config

    cfg = TrainConfig.load(None, ["data.synthetic_size=20"])
    _, tokenizer, examples = build_from_config(cfg)
    line = train_start_line(cfg, tokenizer, examples, torch.device("cpu"))
    assert line.startswith("memory plan: estimated peak ") and "device memory" in line and "checkpointing off" in line
