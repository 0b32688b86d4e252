"""Every config the project ships (examples/, bench/configs/) loads, and the data file it
names exists: a relative data.path means the config file's directory, and
bench/configs/smollm2-readme.yaml once pointed below itself, so the command docs/memory.md
gives failed with "data file ... does not exist" after the model had loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from portarl.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted([*ROOT.glob("examples/*.yaml"), *ROOT.glob("bench/configs/*.yaml")])


def test_there_are_shipped_configs():
    assert len(SHIPPED) >= 2, SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_shipped_config_loads_and_its_data_exists(path):
    cfg = TrainConfig.load(path)
    if cfg.data.path is not None:
        assert Path(cfg.data.path).is_file(), f"{path.relative_to(ROOT)}: data.path {cfg.data.path} does not exist"
    if cfg.data.sft_path is not None:
        assert Path(cfg.data.sft_path).is_file(), f"{path.relative_to(ROOT)}: data.sft_path {cfg.data.sft_path} is missing"
    if cfg.tools or cfg.environment is not None:  # the tools it names load, with their schemas (docs/agents.md)
        from portarl.multiturn.environment import load_factories
        from portarl.multiturn.tools import load_tools

        assert len(load_tools(cfg.tools, [cfg.source_dir])) == len(cfg.tools)
        load_factories(cfg.environment, [cfg.source_dir])


def test_the_agents_recipe_runs_its_tool_and_its_environment(tmp_path):
    """docs/agents.md's one-minute recipe, as a newcomer runs it (the CLI, one torch thread,
    from another directory), with 2 GRPO steps instead of 20: the
    built-in tiny-chat model writes calls that the multiply tool answers with the product of
    the arguments it wrote, and the environment scores the reply after it. The warm-up
    matters: without it the random model writes no call (tool calls 0 of 16)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "run"
    sets = ["train.steps=2", "logging.progress=false", "logging.plot=false",
            "logging.tensorboard=false", "logging.samples_every=1", "logging.samples_count=16"]
    proc = subprocess.run([sys.executable, "-m", "portarl", "train", "--config", str(ROOT / "examples/agents-tiny.yaml"),
                           "--output-dir", str(out), *[x for s in sets for x in ("--set", s)]],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "per episode   first 2 steps: tool calls" in proc.stdout, proc.stdout
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "agent/tool_calls" in m]
    assert len(steps) == 2
    for m in steps:  # per episode, means over the step's 16 episodes
        assert m["agent/tool_calls"] > 0.5 and m["agent/tool_success_frac"] > 0.5, m
        assert m["agent/env_steps"] > 0.5 and m["agent/finish_done_frac"] > 0.5, m
    ran = 0
    for sample in map(json.loads, (out / "samples.jsonl").read_text().splitlines()):
        assert set(sample["rewards"]) == {"environment", "agents_tiny:used_the_tool"}
        messages = sample["conversation"]
        for call, result in zip(messages, messages[1:]):
            if call.get("tool_calls") and result["role"] == "tool" and not result["content"].startswith("Error"):
                args = call["tool_calls"][0]["arguments"]
                assert result["content"] == str(args["a"] * args["b"])  # the tool itself answered
                ran += 1
    assert ran >= 8, ran


def test_the_tiny_chat_model_without_the_warm_up_writes_no_tool_call(tmp_path):
    """Why the recipe has a warm-up (docs/agents.md): the random model's replies hold no call."""
    from portarl.assets.models import build_model
    from portarl.trainer import GRPOTrainer

    cfg = TrainConfig.load(ROOT / "examples/agents-tiny.yaml", [
        f"output_dir={tmp_path / 'run'}", "train.sft_warmup_steps=0", "train.steps=1", "rollout.max_new_tokens=16",
        "rollout.group_size=2", "train.prompts_per_step=4",
        "logging.progress=false", "logging.plot=false", "logging.tensorboard=false"])
    from portarl.assets.data import load_examples_for

    model, tokenizer = build_model(cfg.model)
    trainer = GRPOTrainer(model, tokenizer, None, load_examples_for(cfg.data), cfg, device="cpu")
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert metrics["agent/tool_calls"] == 0 and metrics["agent/env_steps"] > 0
