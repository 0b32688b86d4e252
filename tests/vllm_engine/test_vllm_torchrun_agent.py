"""Multi-turn episodes on a tensor-parallel vllm engine under torchrun (issue 36): 2 Gloo
ranks on the CPU share one engine (``rollout.tensor_parallel_size=2``), each playing its own
groups' episodes against an environment whose answers differ by rank on purpose
(``agent_tools.RankEnv``: its rank and pid; rank 0's episodes end after one turn, rank 1's
after three).

What is checked (``vllm_torchrun_worker.py`` probes each rank): the run trains; both ranks
made the same engine calls, with identical requests (the group's prompts and seeds) and
read identical outputs (vLLM's external launcher broadcasts nothing: every rank's
scheduler must see the same requests); rank 0 kept taking part after its own episodes had
ended (the lock step), and each rank's episodes hold its own environment's answers, which
reached the engine through the group's requests; each rank's rows are its own (its
log-probs equal the trainer's on its episodes within ``ROLLOUT_FP32_ATOL``), at every step
after a sync of weights that the step before moved (issue 58: the guard of
tests/run_guard.py on a checkpoint after each step; ``agent_tools:reward_final_length`` gives
the groups spread).

Time: no fixed deadline; the subprocess limit only bounds a run that has already hung.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_tiny import NO_VLLM, TINY
from vllm_trained import assert_steps_moved, checkpoints

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)

from portarl.parity.tolerances import ROLLOUT_FP32_ATOL  # noqa: E402
from portarl.runtime.distributed import local_launcher

HERE = Path(__file__).parent
TRAINER_TESTS = HERE.parent / "trainer"
sys.path.insert(0, str(TRAINER_TESTS))

from agent_tiny import save_agent_run_files  # noqa: E402

STEPS, PROMPTS, G, TURNS = 3, 2, 4, 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-agent")
    model, data = save_agent_run_files(root, **TINY)  # talkative: ends its turns within a few tokens
    out, probe = root / "run", root / "probe"
    probe.mkdir()
    sets = ["rollout.engine=vllm", "rollout.tensor_parallel_size=2", f"model.path={model}", f"data.path={data}",
            "environment=agent_tools:RankEnv",
            "rewards=[{name: environment}, {name: 'agent_tools:reward_final_length'}]", f"rollout.max_turns={TURNS}",
            "rollout.max_new_tokens=12", f"rollout.group_size={G}", f"train.prompts_per_step={PROMPTS}",
            f"train.steps={STEPS}", "train.sft_warmup_steps=0", "rollout.vllm_gpu_memory_utilization=0.1",
            "logging.progress=false", "logging.tensorboard=false", "logging.plot=false", *checkpoints(STEPS)]
    cmd = [*local_launcher(2), str(HERE / "vllm_torchrun_worker.py"), str(probe), "train", "--device", "cpu", "--output-dir", str(out),
           *[arg for item in sets for arg in ("--set", item)]]
    path = [str(HERE), str(TRAINER_TESTS), os.environ.get("PYTHONPATH", "")]  # the worker, agent_tools
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out, [json.loads((probe / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.compares_runs
def test_two_ranks_sharing_one_engine_train_multiturn_steps(run):
    out, ranks = run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["skipped"] == 0 for r in rows)
    assert_steps_moved(out, STEPS, "2 ranks, one tp2 engine, multi-turn")  # (was: every grad_norm > 0)
    assert all(rank["engines"] == [{"backend": "external_launcher", "tensor_parallel_size": 2}] for rank in ranks)


def test_every_rank_sends_the_same_requests_and_reads_the_same_outputs(run):
    _, ranks = run
    calls = [rank["group"] for rank in ranks]
    assert len(calls[0]) == len(calls[1]) > STEPS  # several turns a step
    for k, (zero, one) in enumerate(zip(*calls)):
        for key in ("prompts", "seeds", "completions", "logprobs"):
            assert zero[key] == one[key], f"engine call {k}: the ranks' {key} differ"
        n = len(zero["prompts"])
        assert zero["rows"] == [0, n // 2] and one["rows"] == [n // 2, n]  # each rank its half, in rank order


def test_each_rank_plays_its_own_episodes_with_its_own_environment(run):
    """Rank 0's episodes all ended after one turn while rank 1's ran up to three, yet rank 0
    took part in every call of the group (the lock step: it padded the later turns); each
    rank's episodes hold only its own environment's answers, and those answers reached the
    engine: a later turn's context of rank 1 is among the requests rank 0 sent too."""
    _, ranks = run
    for r, rank in enumerate(ranks):
        assert len(rank["episodes"]) == STEPS and all(len(step) == PROMPTS // 2 * G for step in rank["episodes"])
        episodes = [ep for step in rank["episodes"] for ep in step]
        answers = [m["content"] for ep in episodes for m in ep["messages"] if m["role"] != "assistant"]
        assert all(a == f"rank {r} pid {rank['pid']}" for a in answers), (r, answers[:3])
        if r == 0:
            assert all(ep["turns"] == 1 for ep in episodes) and not answers
            continue
        assert answers and max(ep["turns"] for ep in episodes) == TURNS
        sent_by_rank0 = [p for call in ranks[0]["group"] for p in call["prompts"]]
        later_turns = [p for p in sent_by_rank0 for ep in episodes
                       if len(p) > ep["prompt_len"] and ep["tokens"][: len(p)] == p]
        assert later_turns, "no context of rank 1's later turns reached the engine through rank 0's requests"
    assert len(ranks[0]["group"]) > STEPS  # rank 0 called the engine after its own episodes had ended


@pytest.mark.compares_runs
def test_each_ranks_logprobs_equal_the_trainers_on_its_own_episodes(run):
    out, ranks = run
    assert_steps_moved(out, STEPS - 1, "2 ranks, one tp2 engine, multi-turn")  # what the later syncs carry
    for r, rank in enumerate(ranks):
        gaps = [m["mismatch/abs_diff_max"] for m in rank["metrics"]]
        assert len(gaps) == STEPS
        assert all(gap < ROLLOUT_FP32_ATOL for gap in gaps), f"rank {r}: max |d logp| per step {gaps}"
