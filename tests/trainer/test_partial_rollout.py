"""Partial rollouts (``rollout.partial``, issue 60): the async worker's pool of sequences in
flight. Completion lengths come from ``PORTARL_BENCH_LENGTHS`` (a heavy tail drawn from each
sample's seed: the tiny model's own lengths do not spread), so that groups complete at
different times and some are carried into the next step.

- the pool (portarl.rollout.partial) on a fake engine: first complete groups first, whole
  groups per call, restart and cut across versions, its state round-tripping JSON;
- a run at staleness 0: every token sampled by the weights it is trained on, the engine's
  log-probs equal the trainer's within ``ROLLOUT_FP32_ATOL`` (colocated-equivalent);
- a run at staleness 2: groups mix steps, samples span versions, no token older than 2;
- SIGKILL of the trainer with sequences in flight, then ``--resume``: the run ends with the
  uninterrupted run's metrics, batches and weights, bitwise (no sample lost or repeated).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import run_guard
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL
from portarl.rollout.async_worker import FAULT_ENV
from portarl.rollout.base import RolloutBatch, SamplingParams
from portarl.rollout.bench_lengths import ENV as LENGTHS_ENV
from portarl.rollout.partial import PartialPool, continuation_seed
from portarl.trainer.checkpoint import CheckpointManager
from test_async_rollout import VARIED, _jsonl, _start, _wait_rows

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the worker dies with the trainer on Linux")

TAIL = {LENGTHS_ENV: "tail:2:40"}
SETS = ("train.steps=6", "rollout.max_new_tokens=40", "rollout.partial=true", VARIED)
#: Tokens carry from one batch's decode into the next from max_staleness 2 on (the batch of
#: step k is decoded one step ahead, under version k - 2: portarl/rollout/partial_schedule.py).
#: 7 steps: the batches of the last steps come due together (the requests stop at the last
#: step), so the SIGKILL test's hang at step 6 comes after checkpoint 4 only with a step 7.
STALE2 = ("rollout.max_staleness=2", "train.steps=7")


# ------------------------------------------------------------------------------- the pool
class FakeEngine:
    """Each row ends after the length its seed maps to (read from ``lengths``), one token
    (7) at a time with log-prob -1; stops where ``stop_when`` says so."""
    supports_stop_when = True

    def __init__(self, lengths: dict):
        self.lengths, self.calls = lengths, []

    def generate(self, prompts, seeds, params, row_limits=None, stop_when=None, end_at=None):
        self.calls.append(len(prompts))
        left = [self.lengths.get(s, 1) for s in seeds]
        tokens = [[] for _ in prompts]
        done = [False] * len(prompts)
        for _ in range(params.max_new_tokens):
            for i in range(len(prompts)):
                if not done[i]:
                    tokens[i].append(7)
                    done[i] = len(tokens[i]) >= left[i] or len(tokens[i]) >= row_limits[i]
            if all(done) or stop_when(torch.tensor(done)):
                break
        finished = [len(t) >= n for t, n in zip(tokens, left)]
        return RolloutBatch([list(p) for p in prompts], tokens, [[-1.0] * len(t) for t in tokens], finished)


def _pool(lengths_by_group, staleness=1, overflow="restart", max_rows=None, group_size=2):
    pool = PartialPool(max_new_tokens=20, max_staleness=staleness, overflow=overflow, max_rows=max_rows)
    seeds = list(range(len(lengths_by_group) * group_size))
    pool.add(1, [[1]] * len(lengths_by_group), [{"i": i} for i in range(len(lengths_by_group))],
             list(range(len(lengths_by_group))), seeds, group_size)
    targets = {seeds[i * group_size + j]: n for i, ns in enumerate(lengths_by_group) for j, n in enumerate(ns)}
    # a continuation's seed (portarl.rollout.partial.continuation_seed) -> the tokens it has left
    lengths = {continuation_seed(seed, k): n - k for seed, n in targets.items() for k in range(n)}
    return pool, FakeEngine(lengths)


def test_the_first_complete_groups_are_handed_out_and_the_rest_stay_in_flight():
    pool, engine = _pool([(9, 12), (2, 3), (4, 1), (20, 5)])
    pool.decode(engine, SamplingParams(max_new_tokens=20), version=0, need=2)
    assert [g.index for g in pool.take(2)] == [1, 2]  # the short groups, not the first asked for
    left = {g.index: [len(s.tokens) for s in g.samples] for g in pool.groups}
    assert left == {0: [4, 4], 3: [4, 4]}  # stopped where 2 groups were complete: 4 tokens in
    pool.decode(engine, SamplingParams(max_new_tokens=20), version=1, need=1)
    [g] = pool.take(1)
    assert g.index == 0 and [s.versions for s in g.samples] == [[0] * 4 + [1] * 5, [0] * 4 + [1] * 8]
    assert [continuation_seed(5, 0), continuation_seed(5, 4)] == [5, continuation_seed(5, 4)] != [5, 5]


def test_a_sequence_spanning_too_many_versions_is_restarted_or_cut():
    for overflow in ("restart", "cut"):
        pool, engine = _pool([(2, 2), (15, 15)], staleness=0, overflow=overflow)
        pool.decode(engine, SamplingParams(max_new_tokens=20), version=0, need=1)
        assert [len(s.tokens) for s in pool.groups[0].samples] == [2, 2]  # in flight, version 0
        pool.on_version(1)
        if overflow == "restart":
            assert [len(s.tokens) for s in pool.groups[0].samples] == [0, 0] and pool.stats["restarted"] == 2
        else:
            assert not pool.groups and [s.finished for s in pool.complete[-1].samples] == [False, False]
            assert pool.stats["cut"] == 2


def test_a_call_takes_whole_groups_up_to_max_rows_and_the_state_round_trips():
    pool, engine = _pool([(3, 3), (3, 3), (3, 3)], max_rows=5)
    pool.decode(engine, SamplingParams(max_new_tokens=20), version=0, need=3)
    assert engine.calls == [4, 2]  # two whole groups (4 rows <= 5), then the third
    pool2, engine2 = _pool([(30, 30)])
    pool2.decode(engine2, SamplingParams(max_new_tokens=20), version=2, need=1)
    assert [len(s.tokens) for s in pool2.complete[0].samples] == [20, 20]  # the token limit (20) ends them
    assert [s.finished for s in pool2.complete[0].samples] == [False, False]
    state = json.loads(json.dumps(pool.state()))
    restored = PartialPool(max_new_tokens=20, max_staleness=1)
    restored.restore(state)
    assert json.dumps(restored.state()) == json.dumps(pool.state())


def test_a_sample_too_old_for_the_batch_is_restarted_even_when_done_and_its_group_goes_back():
    """The batch of step k may hold no token older than version k - 1 - max_staleness. A group
    that completed early waits in the pool's complete list with its old tokens; expire()
    restarts such samples (tried once by hand: without expire() in the schedule's batch, the
    tail-length run below hung after step 4, as the same run from the CLI did)."""
    pool, engine = _pool([(2, 2), (15, 15)], staleness=1)
    pool.decode(engine, SamplingParams(max_new_tokens=20), version=0, need=1)
    assert [g.index for g in pool.complete] == [0] and pool.groups[0].index == 1
    assert pool.expire(0) == 0 and [g.index for g in pool.complete] == [0]  # version 0 still allowed
    assert pool.expire(1) == 4  # both groups' samples hold version-0 tokens
    assert not pool.complete and [g.index for g in pool.groups] == [0, 1]  # back, in arrival order
    assert all(not s.done and not s.tokens and s.restarts == 1 for g in pool.groups for s in g.samples)


def test_a_step_asked_again_is_owed_before_the_later_ones(monkeypatch):
    """A batch the trainer dropped as too stale is asked for again after the next step's
    request: the worker owes it first (it appended it last and waited for a request that
    never came: the same hang)."""
    from types import SimpleNamespace

    from portarl.rollout.partial_schedule import PartialSchedule

    r = SimpleNamespace(max_new_tokens=8, max_staleness=2, partial_overflow="restart", partial_segment=64,
                        max_batch_size=None, group_size=2, seed_mode="per_sample")
    schedule = PartialSchedule(SimpleNamespace(rollout=r, train=SimpleNamespace(prompts_per_step=1, steps=10, seed=0)))
    handed = []
    monkeypatch.setattr(schedule, "batch", lambda worker, step: handed.append(step) or {"op": "batch", "step": step})
    worker = SimpleNamespace(fault=None)

    def ask(step):
        return list(schedule.request(worker, {"step": step, "prompts": [[1]], "examples": [{}], "indices": [0]}))

    assert ask(1) == [] and ask(2) == [{"op": "batch", "step": 1}]
    ask(3), ask(4), ask(5), ask(6)
    assert handed == [1, 2, 3, 4, 5]
    assert ask(5) == [{"op": "batch", "step": 5}]  # asked again: owed before 6, and due at once


def test_long_tailed_lengths_never_hand_out_a_batch_too_stale_to_train():
    """Found by ``portarl bench async --lengths tail:4:96``: early-completed groups carried a
    token two versions old into a later batch, the trainer dropped it, and the run hung."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tail"
        _finish(_start(out, "train.steps=8", "rollout.max_new_tokens=24", "rollout.partial=true", VARIED,
                       "rollout.timeout_s=120", **{LENGTHS_ENV: "tail:4:24"}))
        rows = _jsonl(out / "metrics.jsonl")
        events = (out / "events.jsonl").read_text() if (out / "events.jsonl").exists() else ""
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert "stale_batch_dropped" not in events
    assert max(r["rollout/token_staleness_max"] for r in rows) <= 1.0


# ------------------------------------------------------------------------------- runs
def _finish(proc) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def stale2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("partial-s2")
    _finish(_start(out, *SETS, *STALE2, "checkpoint.every=2", "checkpoint.keep_last=5", **TAIL))
    return out


@pytest.mark.compares_runs
def test_at_staleness_0_every_token_is_the_trained_policys_and_matches_the_trainer(tmp_path):
    out = tmp_path / "s0"
    _finish(_start(out, *SETS, "rollout.max_staleness=0", "train.steps=4", **TAIL))
    rows = _jsonl(out / "metrics.jsonl")
    run_guard.assert_run_trained(out, what="partial rollouts at staleness 0")
    assert [r["rollout/token_staleness_max"] for r in rows] == [0.0] * 4
    for r in rows:  # colocated-equivalent numerics: the engine's log-probs are the trainer's
        assert r["mismatch/abs_diff_max"] <= ROLLOUT_FP32_ATOL, (r["step"], r["mismatch/abs_diff_max"])


def test_at_staleness_2_groups_mix_steps_and_samples_span_versions(stale2):
    rows = _jsonl(stale2 / "metrics.jsonl")
    batches = _jsonl(stale2 / "rollout_batches.jsonl")
    assert [b["step"] for b in batches] == [1, 2, 3, 4, 5, 6, 7]
    assert max(r["rollout/token_staleness_max"] for r in rows) == 2.0
    assert any(r["rollout/versions_per_sample"] > 1 for r in rows), "no sample went on under newer weights"
    assert any(a != b["step"] for b in batches for a in b["asked_at"]), "every group was its own step's"
    assert sum(len(b["prompts"]) for b in batches) == 7 * 4


@pytest.mark.compares_runs
def test_sigkill_with_sequences_in_flight_then_resume_loses_and_repeats_no_sample(tmp_path, stale2):
    out = tmp_path / "killed"
    proc = _start(out, *SETS, *STALE2, "checkpoint.every=2", "checkpoint.keep_last=5", **TAIL, **{FAULT_ENV: "hang@6"})
    try:
        _wait_rows(proc, out, 4)
        manager = CheckpointManager(out)
        limit = time.monotonic() + 600  # bounds a test that has already failed; progress is polled
        while manager.latest() is None or manager.latest().name != "step-000004":  # it holds the pool
            assert proc.poll() is None and time.monotonic() < limit, "checkpoint 4 never came"
            time.sleep(0.05)
        proc.kill()  # step 6's batch never comes: killed with step 5's made and sequences in flight
        proc.wait()
    finally:
        proc.kill()
        proc.communicate()
    state = CheckpointManager.load_state(out / "checkpoints" / "step-000004")
    pool = state["async_in_flight"]["partial_pool"]["pool"]
    assert pool["groups"] or pool["complete"], "the checkpoint of step 4 holds no sequence in flight"
    # the worker decodes one step ahead: step 5's batch was made before checkpoint 4 and is in it
    assert [b["step"] for b in state["async_in_flight"]["batches"]] == [5]
    _finish(_start(out, *SETS, *STALE2, "checkpoint.every=2", "checkpoint.keep_last=5", resume=True, **TAIL))
    run_guard.assert_run_trained(stale2, what="the uninterrupted partial run")
    run_guard.assert_run_trained(out, what="the resumed partial run")
    want, got = _jsonl(stale2 / "metrics.jsonl"), _jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6, 7]
    for a, b in zip(want, got):  # every number but the timings
        differ = {k: (v, b.get(k)) for k, v in a.items() if not k.endswith("_s") and b.get(k) != v}
        assert not differ, f"step {a['step']}: uninterrupted vs resumed {differ}"
    assert _jsonl(out / "rollout_batches.jsonl") == _jsonl(stale2 / "rollout_batches.jsonl")
    final = "checkpoints/step-000007/model.safetensors"
    a, b = load_file(stale2 / final), load_file(out / final)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
