"""Activation checkpointing, token-budget and padding-free micro-batches under FSDP2 (2 Gloo
ranks): the first optimizer step's gradients equal the plain (padded) sharded run's within
fp32 rounding, and checkpointing adds no all-gather (worker: memory_worker.py). LoRA is
refused with several ranks, so it is tested on one process (tests/trainer/test_memory_*.py,
test_padding_free.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from portarl.runtime.distributed import local_launcher

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import run_guard  # noqa: E402

HERE = Path(__file__).parent
#: Same math, other order of fp32 sums (recompute: none; packs: more backward passes).
RTOL, ATOL = 1e-5, 1e-7


@pytest.mark.compares_runs
def test_checkpointing_and_budget_give_the_plain_gradients_on_two_ranks(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    cmd = [*local_launcher(2), str(HERE / "memory_worker.py"),
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    plain = load_file(tmp_path / "plain.safetensors")
    run_guard.assert_gradient_flows(plain, what="the plain step's gradients")  # zero gradients agree in every layout
    # The recompute runs inside the backward's all-gather (the checkpoint wraps each layer's
    # forward, FSDP2's hooks stay outside it): no extra all-gather per step.
    gathers = json.loads((tmp_path / "all_gathers.json").read_text())
    assert gathers["plain"] > 0 and gathers["checkpointing"] == gathers["plain"], gathers
    for name in ("checkpointing", "budget", "both", "padding_free", "one_row"):
        other = load_file(tmp_path / f"{name}.safetensors")
        assert other.keys() == plain.keys(), name
        run_guard.assert_gradient_flows(other, what=f"the {name} step's gradients")
        for k in plain:
            torch.testing.assert_close(other[k], plain[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{name} {k}: {m}")
