"""The memory plan: model shapes read without weights (tiny, config.json, GGUF header) give
the real parameter counts; its parts move the way the settings say; ``portarl plan``'s
output and exit codes. Estimate-versus-measurement lives in docs/memory.md (a benchmark,
``portarl bench memory``), not here."""

from __future__ import annotations

import pytest

from portarl.cli import main
from portarl.assets.models import build_tiny, load_gguf
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


def test_a_qwen3_directory_counts_its_q_and_k_norms(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    model.save_pretrained(tmp_path)
    assert arch_of(TrainConfig.load(None, [f"model.path={tmp_path}"]).model).params == _count(model)


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

    from portarl.cli.plan import train_start_line
    from portarl.trainer import build_from_config

    cfg = TrainConfig.load(None, ["data.synthetic_size=20"])
    _, tokenizer, examples = build_from_config(cfg)
    line = train_start_line(cfg, tokenizer, examples, torch.device("cpu"))
    assert line.startswith("memory plan: estimated peak ") and "device memory" in line and "checkpointing off" in line


GIB = 2**30


def _vllm_plan(*sets, device_memory=80 * GIB, accelerator=True, sleep_level=None):
    cfg = TrainConfig.load(None, ["rollout.engine=vllm", "rollout.vllm_gpu_memory_utilization=0.25", *sets])
    if sleep_level is not None:  # rollout.sleep_level (issue 36) where the config has it; set here either way
        cfg.rollout.sleep_level = sleep_level
    return cfg, estimate(cfg, arch_of(cfg.model), prompt_tokens=10, device_memory=device_memory, accelerator=accelerator)


def test_the_vllm_engines_share_is_held_or_in_the_rollout_phase_by_its_sleep_level(monkeypatch):
    from portarl.trainer.memory.report import render

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = TrainConfig.load(None, [])
    arch = arch_of(cfg.model)
    hf = estimate(cfg, arch, prompt_tokens=10, device_memory=80 * GIB, accelerator=True)
    weights, share = arch.params * 4, 20 * GIB  # fp32 copy; 0.25 of 80 GiB
    cfg, awake = _vllm_plan()
    assert awake.parts["vLLM weights"] == weights
    assert awake.parts["vLLM weights"] + awake.parts["vLLM KV cache + activations"] == share
    assert "rollout KV cache" not in awake.parts and "rollout prefill + sampling" not in awake.parts  # inside vLLM's share
    assert awake.static == hf.static + share and awake.rollout == 0  # level 0: held through the update
    assert "sleep level 0" in render(awake, cfg)
    for level in (1, 2):
        sets = ["rollout.vllm_sleep_mode=true"] if level == 1 else []
        cfg, asleep = _vllm_plan(*sets, sleep_level=level if level == 2 else None)
        assert asleep.static == hf.static and asleep.rollout == share and asleep.phase == "rollout"
        assert asleep.peak == hf.static + share
        text = render(asleep, cfg)
        assert f"sleep level {level}" in text and ("wait in host memory" in text) == (level == 1), text
    # async: every worker holds its policy copy and its engine the whole run; no rollout phase
    _, two = _vllm_plan("rollout.mode=async", "rollout.num_workers=2")
    assert two.static == hf.static + 2 * (weights + share) and two.rollout == 0
    cfg = TrainConfig.load(None, ["rollout.engine=vllm", "rollout.vllm_gpu_memory_utilization=0.25",
                                  "rollout.mode=async", "rollout.num_workers=2"])
    cfg.rollout.worker_devices = ["cuda:6", "cuda:7"]  # rollout.worker_devices: each worker on a device of its own
    cfg.rollout.sync_comm = "gloo"  # through host memory: nothing of the sync on a device
    own = estimate(cfg, arch, prompt_tokens=10, device_memory=80 * GIB, accelerator=True)
    assert own.static == hf.static and own.rollout == 0
    assert any("each on a device of its own" in note and "20.00 GiB there" in note for note in own.notes), own.notes
    cfg.rollout.sync_comm, cfg.rollout.sync_bucket_mb = "auto", 64  # device to device where it can run
    synced = estimate(cfg, arch, prompt_tokens=10, device_memory=80 * GIB, accelerator=True)
    assert synced.static == hf.static + 2 * 64 * 2**20 and synced.parts["weight-sync bucket buffers"] == 2 * 64 * 2**20
    there = f"{(share + weights) / GIB:.2f} GiB there"  # the engine's share and one staged version
    assert any(there in note and "staged" in note for note in synced.notes), synced.notes
    # vllm-cpu: VLLM_CPU_KVCACHE_SPACE sizes the KV cache where it is set
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    _, cpu = _vllm_plan(accelerator=False)
    assert cpu.parts["vLLM KV cache + activations"] == 3 * GIB
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    _, unknown = _vllm_plan(device_memory=None)
    assert unknown.parts["vLLM KV cache + activations"] == 0 and "--device-memory" in " ".join(unknown.notes)


def test_a_vllm_share_that_does_not_fit_names_the_sleep_level_and_the_share(monkeypatch):
    from portarl.trainer.memory.report import advice

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg, plan = _vllm_plan("rollout.vllm_gpu_memory_utilization=1", device_memory=2 * GIB)  # and the trainer beside it
    assert plan.fits is False
    tips = " ".join(advice(plan, cfg))
    assert "sleep" in tips and "rollout.vllm_gpu_memory_utilization (now 1;" in tips, tips
    cfg, tight = _vllm_plan("rollout.vllm_gpu_memory_utilization=0.01", device_memory=10 * 2**20)  # < its weights
    assert "leaves no room for a KV cache" in " ".join(tight.notes)
