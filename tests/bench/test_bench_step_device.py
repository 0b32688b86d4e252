"""``portarl bench step --device``: portarl's whole GRPO step beside the plain one (full
logits, fp32 log_softmax, gather) in one process, on the tiny shape on this CPU. The GPU
shapes (Qwen2.5-0.5B / 1.5B sizes) run the same code on a GPU (docs/hardware-ci.md)."""

from __future__ import annotations

import json

import pytest
import torch

import run_guard
from portarl.bench.step_device import SHAPES, build, run, sized_tokenizer
from portarl.cli import main


def test_the_plain_step_computes_portarls_gradient_on_the_same_batches():
    """The two sides train on the same rollout and advantages: on the CPU in fp32, the plain
    step's gradient norm equals portarl's (its fused linear log-probs, no logits tensor)
    within fp32 rounding, and both are > 0 (the digit-share reward has spread)."""
    result = run("cpu", ["tiny"], steps=2, warmup=1)
    [shape] = result["shapes"]
    for record in shape["steps"]:
        run_guard.assert_gradient_flows([torch.tensor([record["grad_norm"]])],
                                        what=f"portarl's step {record['step']}")
        assert record["plain_grad_norm"] == pytest.approx(record["grad_norm"], rel=1e-4), record
        assert record["completion_tokens"] == 2 * 2 * 8  # a random model never ends a sample
    summary = shape["summary"]
    for side in ("portarl", "plain"):
        assert summary[side]["step_s"] > 0 and summary[side]["tokens_per_s"] > 0
    assert summary["plain"]["step_s"] == pytest.approx(summary["rollout_s"] + summary["scoring_s"]
                                                       + summary["plain"]["update_s"])


def test_the_command_writes_its_table_and_json(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--device", "cpu", "--shapes", "tiny", "--device-steps", "2",
                 "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| tiny |" in table and "plain update s" in table
    assert json.loads(out.read_text())["shapes"][0]["shape"] == "tiny"
    assert main(["bench", "step", "--device", "cpu", "--shapes", "qwen9"]) == 2
    assert "--shapes qwen9: unknown" in capsys.readouterr().err
    assert main(["bench", "step", "--device", "cpu", "--vs", "trl"]) == 2


def test_the_shipped_shapes_are_qwen25s_sizes_and_every_id_decodes():
    model, tok = build("tiny")
    assert len(tok) == SHAPES["tiny"]["vocab_size"] == model.config.vocab_size
    assert tok.decode([5, 300, 511]) and tok.encode("12+3") == list(tok.encode("12+3"))
    big = sized_tokenizer(SHAPES["qwen2.5-0.5b"]["vocab_size"])
    assert len(big) == 151_936 and big.decode([151_935])
    assert SHAPES["qwen2.5-1.5b"]["hidden_size"] == 1536 and SHAPES["qwen2.5-0.5b"]["num_hidden_layers"] == 24
