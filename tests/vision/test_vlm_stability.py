"""The stability harness and locate on a vision-language model (issue 47): two settings of
the colours example record and replay the same rollouts (pixels and M-RoPE positions go
with every forward, the example's own reward module is found from the harness's copy of
the config), a step is dumped per module on both, and locate compares them: the vision
tower's modules are in the dumps and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from portarl.cli import main

pytest.importorskip("PIL.Image")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm-colours.yaml"


def test_vlm_runs_record_replay_dump_and_locate_with_the_vision_tower(tmp_path, capsys):
    out = tmp_path / "stability"
    assert main(["bench", "stability", "--config", str(EXAMPLE), "--runs", "cpu:fp32,cpu:bf16", "--steps", "2",
                 "--replay-rollouts", "--set", "train.sft_warmup_steps=4", "--set", "eval.data=null",
                 "--set", "train.prompts_per_step=2", "--out", str(out)]) in (0, 1)
    runs = json.loads((out / "stability.json").read_text())
    assert not any(r.get("crashed") for r in runs["runs"]), runs["runs"]
    dumps = []
    for run in ("cpu:fp32", "cpu:bf16"):
        dump = tmp_path / run.replace(":", "-")
        assert main(["bench", "stability", "dump", "--from", str(out), "--step", "2", "--run", run,
                     "--out", str(dump)]) == 0
        dumps.append(dump)
    names = {e["name"] for e in json.loads((dumps[0] / "index.json").read_text())["entries"]}
    assert any(n.startswith("model.visual.blocks.") for n in names), sorted(names)[:10]
    report = tmp_path / "locate"
    capsys.readouterr()
    assert main(["bench", "stability", "locate", str(dumps[0]), str(dumps[1]), "--out", str(report)]) in (0, 1)
    assert "model.visual" in (report / "locate.md").read_text()
