"""``portarl plan`` for mixture-of-experts models (issue 48): total, active and expert
parameters from the config equal the built models' own parameter sums; the routing-replay
buffers equal what the engine records and what :func:`portarl.moe.routing.routing_rows`
builds; the plan prints them."""

from __future__ import annotations

import pytest
import torch

from portarl.cli import main
from portarl.moe import routing
from portarl.moe.models import BUILTIN_MOES, build_tiny_moe
from portarl.trainer.config import TrainConfig
from portarl.trainer.memory.arch import arch_of
from portarl.trainer.memory.moe import replay_device_bytes, replay_host_bytes
from portarl.trainer.memory.plan import estimate


def _sums(model) -> tuple[int, int, int]:
    """``(all, routed experts, one routed expert per MoE layer x (E - k))`` from the modules."""
    total = sum(p.numel() for p in model.parameters())
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    expert = sum(p.numel() for m in experts for p in m.parameters())
    skipped = 0
    for m, router in zip(experts, routing.routers(model)):
        one = sum(p[0].numel() for p in m.parameters())  # expert 0's slices of the stacked weights
        skipped += (router.num_experts - router.top_k) * one
    return total, expert, total - skipped


@pytest.mark.parametrize("name", list(BUILTIN_MOES))
def test_builtin_counts_equal_the_built_models(name):
    model, _ = build_tiny_moe(name)
    arch = arch_of(TrainConfig.load(None, [f"model.path={name}"]).model)
    total, expert, active = _sums(model)
    assert arch.moe is not None and arch.moe.moe_layers == len(routing.routers(model)) == 2
    assert arch.params == total
    assert arch.moe.all_expert_params(arch.hidden) == expert
    assert arch.active_params == active < total


def _save(tmp_path, config):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_a_directory_counts_dense_layers_untied_heads_and_num_local_experts(tmp_path, family):
    """A Qwen MoE with a dense layer (``mlp_only_layers``) and an untied head; Mixtral's
    ``num_local_experts`` with the experts' width in ``intermediate_size``."""
    from transformers import MixtralConfig

    from portarl.moe.models import tiny_moe_config

    if family == "mixtral":
        config = MixtralConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2)
    else:
        config = tiny_moe_config(family, 50, hidden_size=32, layers=3)
        config.mlp_only_layers = [1]
        config.tie_word_embeddings = False
    model = _save(tmp_path / "m", config)
    arch = arch_of(TrainConfig.load(None, [f"model.path={tmp_path / 'm'}"]).model)
    total, expert, active = _sums(model)
    assert arch.moe.moe_layers == len(routing.routers(model))
    assert (arch.params, arch.moe.all_expert_params(arch.hidden), arch.active_params) == (total, expert, active)
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    assert arch.layer_params == largest  # FSDP2's unsharded working set


def test_replay_buffers_equal_the_record_and_the_routing_rows():
    name = "tiny-qwen3-moe"
    model, _ = build_tiny_moe(name)
    moe = arch_of(TrainConfig.load(None, [f"model.path={name}"]).model).moe
    p, c, rows = 5, 4, 3
    ids = torch.randint(3, 70, (1, p + c))
    with routing.recording(model) as calls, torch.no_grad():
        model(input_ids=ids)
    record = torch.stack([layer[0] for layer in calls])  # [layers, tokens, k] int16, one sample
    assert record.dtype == torch.int16 and record.shape == (moe.moe_layers, p + c, moe.top_k)
    assert replay_host_bytes(moe, p + c) == record.numel() * record.element_size()
    fed = [record[:, : p + c - 1]] * rows  # what the engine feeds: the prompt, the completion but its last token
    rows_ = routing.routing_rows(fed, [p] * rows, [c] * rows, p, c, "cpu")
    built = rows_.experts.numel() * rows_.experts.element_size() + rows_.known.numel() * rows_.known.element_size()
    assert replay_device_bytes(moe, rows, p + c) == built


def test_the_plan_adds_the_replay_buffers_and_prints_the_counts(capsys):
    sets = ["model.path=tiny-qwen2-moe", "rollout.max_new_tokens=16"]
    off = TrainConfig.load(None, sets)
    on = TrainConfig.load(None, [*sets, "rollout.routing_replay=rollout"])
    arch = arch_of(on.model)
    plan_off, plan_on = (estimate(c, arch, prompt_tokens=8) for c in (off, on))
    rows = on.train.prompts_per_step * on.rollout.group_size
    device = replay_device_bytes(arch.moe, rows, 8 + 16)
    assert plan_on.parts["routing replay rows"] == device
    assert plan_on.parts["routing replay record (host)"] == rows * replay_host_bytes(arch.moe, 8 + 16)  # CPU: host
    assert plan_on.update - plan_off.update == device + rows * replay_host_bytes(arch.moe, 8 + 16)
    accel = estimate(on, arch, prompt_tokens=8, accelerator=True)
    assert accel.parts["routing replay record (host)"] == 0 and accel.parts["routing replay rows"] == device
    assert main(["plan", *(x for s in sets + ["rollout.routing_replay=rollout"] for x in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert f"parameters: {arch.params:,} in all, {arch.active_params:,} active per token" in out
    assert "a shared expert of width 64" in out and "routing replay:" in out and "RoutingRows" in out


def test_the_plan_counts_r2s_rows_and_no_engine_record(capsys):
    """``routing_replay: old``: the trainer's old forward fills the batch's RoutingRows; the
    engine records nothing."""
    sets = ["model.path=tiny-qwen3-moe", "rollout.max_new_tokens=16"]
    off, old = TrainConfig.load(None, sets), TrainConfig.load(None, [*sets, "rollout.routing_replay=old"])
    arch = arch_of(old.model)
    plan_off, plan_old = (estimate(c, arch, prompt_tokens=8) for c in (off, old))
    device = replay_device_bytes(arch.moe, old.train.prompts_per_step * old.rollout.group_size, 8 + 16)
    assert plan_old.parts["routing replay rows"] == device and "routing replay record (host)" not in plan_old.parts
    assert plan_old.update - plan_off.update == device
    assert main(["plan", *(x for s in sets + ["rollout.routing_replay=old"] for x in ("--set", s))]) == 0
    assert "routing replay (old policy's experts)" in capsys.readouterr().out
