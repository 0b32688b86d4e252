"""Seconds-long smoke runs of every benchmark command, so they keep working in CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from portarl.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAST = [
    "train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "data.synthetic_size=64",
    "model.hidden_size=32", "model.intermediate_size=64", "train.sft_warmup_steps=2", "train.micro_batch_size=8",
]


def test_bench_kernels_quick(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--device", "cpu", "--quick", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    methods = {(r["op"], r["method"]) for r in data["results"]}
    assert {("logprobs", "portarl:reference"), ("logprobs", "eager"), ("logprobs", "rowloop"), ("kl", "eager")} <= methods
    assert all(r["median_ms"] is not None for r in data["results"])
    # Copy-bandwidth fractions describe the memory-bound ops; linear_logprobs is a matmul.
    assert all(r["frac_copy_bw"] > 0 for r in data["results"] if r["op"] in ("logprobs", "kl"))
    assert {("linear_logprobs", "portarl:reference"), ("linear_logprobs", "eager")} <= methods
    assert data["copy_bandwidth_bytes_per_s"] > 0 and out.with_suffix(".md").exists()


def test_pytest_benchmark_files(tmp_path):
    env = {**os.environ, "PORTARL_BENCH_QUICK": "1", "PORTARL_BENCH_DEVICE": "cpu"}
    env.pop("TRITON_INTERPRET", None)
    for name in [k for k in env if k.startswith("PYTEST_XDIST_")]:  # make test's worker: pytest-benchmark would
        env.pop(name)  # take this run for an xdist worker and refuse --benchmark-only
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "bench/", "--benchmark-only", "-q", "-p", "no:cacheprovider",
         "-k", "fp32 and (portarl or eager) and not entropy", "--benchmark-min-rounds=1",
         "--benchmark-max-time=0.001", "--benchmark-warmup=off", "--benchmark-disable-gc"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def test_bench_stability_with_replay_and_emulation(tmp_path, capsys):
    args = ["bench", "stability", "--runs", "cpu:fp32,cpu:bf16:npu-emulated", "--steps", "3", "--replay-rollouts",
            "--out", str(tmp_path)]
    for item in FAST:
        args += ["--set", item]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "cpu:fp32: baseline" in out and "cpu:bf16:npu-emulated [EMULATION]" in out
    report = (tmp_path / "report.md").read_text()
    assert "![stability](stability.png)" in report and "[EMULATION]" in report
    assert (tmp_path / "stability.png").exists() and (tmp_path / "rollouts.safetensors").exists()
    analysis = json.loads((tmp_path / "stability.json").read_text())
    assert analysis["replay_rollouts"] is True and len(analysis["runs"]) == 2


def test_bench_stability_bad_runs(capsys):
    assert main(["bench", "stability", "--runs", "cpu"]) == 2
    assert main(["bench", "stability", "--runs", "cpu:bf16:tpu-emulated"]) == 2
    assert "neither a backend" in capsys.readouterr().err
