"""Ulysses sequence parallelism (``train.sequence_parallel_size``) over Gloo on the CPU against
the whole sequence in one process.

- The forward and backward (tests/distributed/ulysses_worker.py): 2 ranks at SP 2 (fp32 and
  bf16) and 4 ranks at SP 2 (two data-parallel groups) and SP 4 (each key / value head
  repeated): log-probs, entropy and every parameter's gradient of a loss of both equal the
  1-process whole-sequence computation within :mod:`portarl.parity.tolerances` (bf16
  gradients: both held to the float64 gradient of the same parameters, SP's error at most
  ``LOW_PRECISION_PATH_ERROR_RATIO`` times the whole row's; a 3% error in the all-to-all's
  backward fails that, tried by hand), on padded
  rows, padding-free rows with a sequence ending on a shard boundary, padding-free rows over
  the dense mask bound (causal rows: the SP forward builds no mask), and rows SP does not
  divide; under sdpa and under flash varlen (tests/varlen_standin.py: the rows' spans reach
  the attention call and are right; wrong spans fail it, tried by hand); also through FSDP2 (the trainer's path); and attention that bypasses the
  all-to-all raises. The worker's checks fail when the gather's backward seeds the wrong
  shard (max |d grad| 4.4) or the labels are shifted after the cut (tried by hand).
- The trainer: a 2-step GRPO run on 2 ranks at SP 2 (padding-free rows, activation
  checkpointing, old log-probs recomputed, a KL reference: scoring and the update both go
  through the shards) equals the 1-process run: the same rollouts, metrics within the
  fp32 reduction-order tolerances of test_fsdp_gloo.py, parameters after 2 steps likewise;
  the same step in the strict HCCL stand-in's process group; and the same step with the
  sequence-parallel forwards under flash varlen attention (the stand-in, the one-row layout).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import run_guard  # noqa: E402
from portarl.runtime.distributed import local_launcher  # noqa: E402
from portarl.trainer.checkpoint import CheckpointManager  # noqa: E402
from test_fsdp_gloo import ATOL, RTOL, _env, _params_from, _rows, _train  # noqa: E402
from test_fsdp_gloo import assert_params_close, assert_trained  # noqa: E402

HERE = Path(__file__).parent
WORKER = HERE / "ulysses_worker.py"
#: Both runs decode through the Hugging Face forward and keep samples whole (test_fsdp_gloo.py
#: says why). Shared-prompt rows at SP 2 give the same metrics (the grad norm to fp32 rounding;
#: a per-position label layout got it wrong: 0.616 against 0.758, which the worker's shared-prompt
#: case now holds), but their halves are matrices of other shapes, and after AdamW's steps
#: down_proj moved past PARAM_ATOL as in test_fsdp_gloo.py.
SAME = ("rollout.lean_decode=false", "train.share_prompt=false")
SP = ("train.sequence_parallel_size=2", "train.gradient_checkpointing=true", "train.old_logprobs=recompute")


def _worker(ranks: int, sizes: str, dtypes: str, saved: Path) -> str:
    """The worker's output; every case it compared passed the guard (its gradients flow)."""
    proc = subprocess.run([*local_launcher(ranks), str(WORKER), sizes, dtypes, str(saved)], env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    _assert_gradients_flow(saved, proc.stdout)
    return proc.stdout


def _assert_gradients_flow(saved: Path, out: str) -> None:
    """Each case's gradients, the whole sequence's and SP's (a loss of log-probs and entropy of
    fixed rows, no optimizer step), are finite and not all 0 (tests/run_guard.py): zero
    gradients would agree in every layout."""
    from safetensors.torch import load_file

    labels = json.loads((saved / "cases.json").read_text())
    grads = load_file(str(saved / "gradients.safetensors"))
    assert labels and all(f"ok {label}:" in out for label in labels), (labels, out)
    for i, label in enumerate(labels):
        for side in ("whole", "sp"):
            prefix = f"{i}/{side}/"
            run_guard.assert_gradient_flows({k: v for k, v in grads.items() if k.startswith(prefix)},
                                            what=f"{label}: the {side} gradients")


@pytest.mark.compares_runs
def test_two_ranks_sp2_equal_the_whole_sequence_fp32_and_bf16(tmp_path):
    out = _worker(2, "2", "float32,bfloat16", tmp_path)
    # 2 dtypes x padded / packed / shared / causal rows x boundary / odd widths, and fp32 flash
    # varlen (no shared-prompt rows) on the other three
    assert out.count("ok torch.") == 2 * 4 * 2 + 3 * 2 and out.count("varlen SP 2") == 3 * 2, out
    assert "ok fsdp2 SP 2" in out and "ok refused unwrapped attention" in out, out


@pytest.mark.compares_runs
def test_four_ranks_sp2_and_sp4_equal_the_whole_sequence(tmp_path):
    out = _worker(4, "2,4", "float32", tmp_path)
    for size in (2, 4):
        assert out.count(f"SP {size} of 4") == 4 * 2 + 3 * 2, out  # 4 layouts x 2 widths; varlen on 3 of them
    assert "ok fsdp2 SP 4" in out and "ok refused unwrapped attention" in out, out


@pytest.fixture(scope="module")
def single_and_sp(tmp_path_factory):
    root = tmp_path_factory.mktemp("ulysses")
    single, sp = root / "single", root / "sp"
    for out, ranks, sets in ((single, 1, ()), (sp, 2, SP)):
        proc = _train(out, ranks, "train.steps=2", *SAME, *sets)
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sequence parallelism (Ulysses): 1 data-parallel groups of 2 ranks" in proc.stderr, proc.stderr[-4000:]
    return single, sp


def _assert_same_steps(single: Path, other: Path, steps: int) -> None:
    """``other``'s first ``steps`` steps equal ``single``'s, and both runs trained (the guard)."""
    assert_trained(single, other)
    a, b = _rows(single), _rows(other)
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a[:steps], b):
        assert ra["reward/mean"] == rb["reward/mean"], "both runs must roll out the same completions"
        for key in ("loss", "pg/loss", "kl/loss", "grad_norm", "entropy", "kl"):
            assert rb[key] == pytest.approx(ra[key], rel=RTOL, abs=ATOL), (rb["step"], key)


@pytest.mark.compares_runs
def test_a_two_step_grpo_run_at_sp2_matches_one_process(single_and_sp):
    single, sp = single_and_sp
    _assert_same_steps(single, sp, 2)
    assert_params_close(_params_from(CheckpointManager(single).latest()), _params_from(CheckpointManager(sp).latest()))


@pytest.mark.compares_runs
def test_the_strict_hccl_standin_runs_the_same_step(single_and_sp, tmp_path):
    single, _ = single_and_sp
    from test_fsdp_gloo import FAST

    cmd = [*local_launcher(2), str(HERE / "strict_hccl_worker.py"), "train", "--device", "cpu", "--output-dir",
           str(tmp_path)]
    # Without activation checkpointing: torch.utils.checkpoint asks the stand-in "npu" device
    # for AMP functions it does not have (a limit of the stand-in, not of the process group).
    for item in (*FAST, "train.steps=1", *SAME, *(s for s in SP if "checkpointing" not in s)):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "process group backend 'cpu:gloo,npu:hccl'" in proc.stderr, proc.stderr[-4000:]
    _assert_same_steps(single, tmp_path, 1)


@pytest.mark.compares_runs
def test_a_step_under_flash_varlen_attention_matches_one_process(single_and_sp, tmp_path):
    """The trainer's own path (FSDP2, scoring and update, the one-row varlen layout) with
    the sequence-parallel forwards under flash varlen attention: the stand-in of
    tests/varlen_standin.py (tests/distributed/ulysses_flash_trainer.py says how)."""
    single, _ = single_and_sp
    from test_fsdp_gloo import FAST

    sets = [*FAST, "train.steps=1", *SAME, *(s for s in SP if "checkpointing" not in s)]
    proc = subprocess.run([*local_launcher(2), str(HERE / "ulysses_flash_trainer.py"), str(tmp_path), *sets],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "ok flash varlen" in proc.stdout, proc.stdout[-2000:]
    _assert_same_steps(single, tmp_path, 1)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
