"""Rewards: both forms, dataset columns, None, `module:function` next to the config, and
every way a user's reward can fail (issue 16 item 2, issue 13 items 3 and 4)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portarl.assets.data import Example
from portarl.assets.reward_runner import RewardError, RewardRunner
from portarl.trainer import GRPOTrainer, TrainingStopped, build_from_config
from trainer_fast import fast_config

ROWS = [Example("1+1=", "2", {"answer": "2", "level": 1}, "d.jsonl:1"),
        Example(({"role": "user", "content": "2+2?"},), None, {"level": 2}, "d.jsonl:2")]


def test_batched_reward_gets_columns_and_none_means_no_reward():
    seen = {}

    def by_level(prompts, completions, level, **kwargs):
        seen.update(prompts=prompts, completions=completions, level=level, kwargs=kwargs)
        return [None if lv == 1 else 0.5 for lv in level]

    def per_sample(prompt, completion, answer):
        return 1.0

    runner = RewardRunner([(by_level, 2.0)])
    scores = runner.score([ROWS[1], ROWS[1]], ["4", "5"])
    assert scores.total.tolist() == [1.0, 1.0] and scores.metrics == {"reward/by_level": 0.5}
    # conversational prompts arrive as messages, completions as an assistant message (as in TRL)
    assert seen["prompts"][0] == [{"role": "user", "content": "2+2?"}]
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    assert seen["level"] == [2, 2] and seen["kwargs"] == {}  # this row has no answer column
    # None from one function: the sample's total is the other functions' weighted sum
    both = RewardRunner([(by_level, 2.0), (per_sample, 0.25)]).score([ROWS[0], ROWS[0]], ["2", "3"])
    assert both.total.tolist() == [0.25, 0.25] and both.per_function["by_level"] == [None, None]
    assert "reward/by_level" not in both.metrics and both.metrics["reward/per_sample"] == 1.0
    with pytest.raises(RewardError, match=r"every reward function returned None for this sample.*sample 0"):
        runner.score([ROWS[0]], ["2"])


def _bad(kind):
    def per_sample(prompt, completion, answer):
        if kind == "raises":
            raise KeyError("boom")
        return {"none": None, "list": [1.0]}[kind]

    def batched(prompts, completions, **columns):
        return [1.0] * (len(prompts) - 1)

    def two_args(prompt, completion):
        return 0.0

    return {"raises": per_sample, "none": per_sample, "list": per_sample, "length": batched, "signature": two_args}[kind]


@pytest.mark.parametrize("kind, message", [
    ("raises", r"reward 'per_sample' raised KeyError: 'boom' on sample 0 \(prompt '1\+1='\)"),
    ("none", r"reward 'per_sample' returned None \(None\), expected a number on sample 0 \(prompt '1\+1='\)"),
    ("list", r"reward 'per_sample' returned list .* on sample 0"),
    ("length", r"reward 'batched' returned 1 values for 2 samples"),
    ("signature", r"reward 'two_args' has the wrong signature for fn\(prompt, completion, answer\): it takes 2 "
                  r"arguments \(prompt, completion\), portarl passes 3: \(prompt, completion, answer\)"),
])
def test_reward_errors_name_the_reward_and_sample(kind, message):
    with pytest.raises(RewardError, match=message):
        RewardRunner([_bad(kind)]).score([ROWS[0], ROWS[0]], ["2", "3"])


def test_missing_column_is_a_signature_error():
    def needs_level(prompts, completions, difficulty):
        return [0.0] * len(prompts)

    with pytest.raises(RewardError, match=r"cannot be called as fn\(prompts, completions, answer=, level=\).*difficulty"):
        RewardRunner([needs_level]).score([ROWS[0]], ["2"])


def test_reward_error_stops_the_run_with_a_checkpoint_of_the_last_good_step(tmp_path):
    calls = []

    def flaky(prompt, completion, answer):
        calls.append(prompt)
        if len(calls) > 16:  # step 1 scores 16 samples; step 2 fails
            raise ValueError("bad parse")
        return 1.0 if completion.strip() == answer else 0.0

    cfg = fast_config(tmp_path, "checkpoint.every=100")
    model, tok, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tok, [flaky], examples, cfg, device="cpu")
    with pytest.raises(TrainingStopped, match=r"stopping at step 2: reward 'flaky' raised ValueError: bad parse on "
                                              r"sample 0 \(prompt '.*'\)\. Checkpoint of step 1") as err:
        trainer.train()
    assert err.value.checkpoint.name == "step-000001" and trainer.step == 1
    from safetensors.torch import load_file

    saved = load_file(str(err.value.checkpoint / "model.safetensors"))
    live = trainer.model.state_dict()
    assert all(torch.equal(saved[k], live[k]) for k in saved)


def test_module_reward_next_to_the_config_and_batched_columns_from_the_cli(tmp_path):
    """`portarl train` run from another directory finds `myrewards.py` beside the config; a
    conversational JSONL without an answer field trains with a batched reward on a column;
    samples.jsonl shows what the model wrote."""
    from chat_tiny import save_chat_model

    save_chat_model(tmp_path / "model")
    cfgdir = tmp_path / "cfg"
    cfgdir.mkdir()
    (cfgdir / "myrewards.py").write_text(
        "def target_len(prompts, completions, target, **kwargs):\n"
        "    return [float(len(c[0]['content'].split()) == t) if t else None for c, t in zip(completions, target)]\n"
        "def always(prompts, completions, **kwargs):\n"
        "    return [0.5] * len(prompts)\n")
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 1 ?"}], "target": a % 3} for a in range(8)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (cfgdir / "run.yaml").write_text(
        f"output_dir: {tmp_path / 'run'}\nmodel: {{path: {tmp_path / 'model'}}}\ndata: {{path: {tmp_path / 'q.jsonl'}}}\n"
        "rewards: [{name: 'myrewards:target_len'}, {name: 'myrewards:always', weight: 0.1}]\n"
        "train: {steps: 2, prompts_per_step: 2, sft_warmup_steps: 0, micro_batch_size: 8}\n"
        "rollout: {group_size: 2, max_new_tokens: 3}\nlogging: {progress: false, tensorboard: false, plot: false, "
        "samples_every: 1, samples_count: 2}\n")
    env = {**os.environ, "PYTHONPATH": ""}
    portarl = [str(Path(sys.executable).with_name("portarl"))]
    if not Path(portarl[0]).exists():
        # portarl run from its tree (not installed, as on the GPU image): the tree alone on the
        # path; -m adds the cwd (the model's folder), never the config's
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
        portarl = [sys.executable, "-m", "portarl"]
    done = subprocess.run([*portarl, "train", "--config", str(cfgdir / "run.yaml")], cwd=tmp_path / "model",
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]
    for s in samples:
        # the prompt as the model read it: the chat template's text around the question
        assert "What is" in s["prompt"] and s["prompt"].rstrip().endswith("assistant") and set(s["rewards"]) == {"myrewards:target_len", "myrewards:always"}
        assert s["rewards"]["myrewards:always"] == 0.5 and s["finish_reason"] in ("stop", "length")
        assert isinstance(s["advantage"], float)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["reward/myrewards:always"] == 0.5 for m in metrics if m.get("phase") == "grpo")
    assert re.search(r"sample at step 1: prompt '.*user What is .*' -> completion", done.stderr), done.stderr[-3000:]
