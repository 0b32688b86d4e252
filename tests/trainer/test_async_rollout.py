"""rollout.mode=async (issue 25): the worker process reproduces colocated mode bitwise at
max_staleness 0, keeps per-sample seeds, is named and stopped on every fault, dies with
the trainer, and a killed run resumes without losing or repeating a batch.

Time: nothing here waits on a fixed deadline. The hang test's ``rollout.timeout_s`` is
derived from a healthy run's measured batch time (x20, at least 30 s); waits for a process
poll its state with generous limits that only bound a test that has already failed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portarl.trainer import GRPOTrainer, TrainingStopped, build_from_config
from portarl.trainer.asynchronous.pipeline import BATCH_LOG, RolloutWorkerError, validate_batch
from portarl.rollout.async_worker import FAULT_ENV
from portarl.trainer.config import ConfigError, TrainConfig

import run_guard
from proc_tree import alive, children, supervised
from trainer_fast import FAST, fast_config

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the worker")
#: A reward that differs within every group from step 1 on (the default rewards score an
#: untrained model 0: no gradient, and runs compared would agree whatever they did). The
#: worker imports it by name: this directory is on the PYTHONPATH of the runs that use it.
VARIED = "rewards=[{name: 'trainer_fast:varied_reward'}]"


def _pythonpath() -> str:
    """This directory on the path, for a reward or a module of it imported by name."""
    return os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])


def _run(path: Path, *overrides: str) -> GRPOTrainer:
    cfg = fast_config(path, *overrides)
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    trainer.train(overwrite=True)
    return trainer


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("colocated")
    _run(out, "train.steps=3", VARIED)
    return out / "run"


@pytest.fixture(scope="module")
def colocated(colocated_run):
    return _jsonl(colocated_run / "metrics.jsonl")


@pytest.fixture(scope="module")
def async_s0(tmp_path_factory):
    out = tmp_path_factory.mktemp("async0")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", _pythonpath())
        _run(out, "train.steps=3", "rollout.mode=async", "rollout.max_staleness=0", VARIED)
    return out / "run"


@pytest.mark.compares_runs
def test_staleness_0_reproduces_colocated_bitwise(colocated_run, colocated, async_s0):
    run_guard.assert_run_trained(colocated_run, what="the colocated run")
    run_guard.assert_run_trained(async_s0, what="the async run at max_staleness 0")
    rows = _jsonl(async_s0 / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for ref, got in zip(colocated, rows):
        differ = {k: (v, got.get(k)) for k, v in ref.items() if not k.startswith("time/") and got.get(k) != v}
        assert not differ, f"step {ref['step']}: {differ}"
        assert got["rollout/staleness_max"] == 0 and got["rollout/version"] == ref["step"] - 1
        for key in ("rollout/wait_s", "train/wait_s", "rollout/staleness_mean"):
            assert key in got
    assert not children(os.getpid()), "the worker outlived the run"


@pytest.mark.compares_runs
def test_model_directory_with_chat_data_reproduces_colocated_at_staleness_0(tmp_path, monkeypatch):
    """The path of examples/smollm2-arith.yaml: a local model directory (a tiny Llama with a
    ChatML tokenizer), conversational JSONL, generation stopped at <|im_end|>. Beside
    math_exact (0 for every sample of the untrained model), trainer_fast.varied_reward: the
    runs compared train."""
    from chat_tiny import chat_tokenizer, tiny_llama

    tok = chat_tokenizer()
    tiny_llama(len(tok)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    with (tmp_path / "data.jsonl").open("w") as f:
        for a in range(1, 9):
            row = {"prompt": [{"role": "user", "content": f"What is {a} plus 1 ?"}], "answer": str(a + 1)}
            f.write(json.dumps(row) + "\n")
    monkeypatch.setenv("PYTHONPATH", _pythonpath())
    sets = (f"model.path={tmp_path / 'model'}", f"data.path={tmp_path / 'data.jsonl'}", "train.steps=2",
            "rewards=[{name: math_exact}, {name: 'trainer_fast:varied_reward'}]", "rollout.max_new_tokens=6")
    _run(tmp_path / "colocated", *sets)
    _run(tmp_path / "async", *sets, "rollout.mode=async", "rollout.max_staleness=0")
    for mode in ("colocated", "async"):
        run_guard.assert_run_trained(tmp_path / mode / "run", what=f"the {mode} run")
    ref, got = (_jsonl(tmp_path / m / "run" / "metrics.jsonl") for m in ("colocated", "async"))
    assert len(ref) == len(got) == 2
    for a, b in zip(ref, got):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
            {k: v for k, v in b.items() if k in a and not k.startswith("time/")}


def test_async_keeps_per_sample_seeds_and_the_detector_fires_on_a_constant_seed(tmp_path, colocated, monkeypatch):
    trainer = _run(tmp_path / "ok", "train.steps=3", "rollout.mode=async")  # max_staleness 1
    rows = _jsonl(tmp_path / "ok" / "run" / "metrics.jsonl")
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    for ref, got in zip(colocated, rows):  # no group identical where colocated's are not
        assert got["rollout/identical_group_frac"] <= ref["rollout/identical_group_frac"] == 0
        assert got["mismatch/abs_diff_max"] > 0 or got["step"] == 1  # the stale batches are corrected
    events = _jsonl(tmp_path / "ok" / "run" / "events.jsonl")
    assert not [e for e in events if e["kind"] == "identical_samples"]
    assert trainer.step == 3
    assert trainer.rollout_if_built is None, "async mode built a rollout engine in the trainer (with vllm: a second vLLM)"

    monkeypatch.setenv(FAULT_ENV, "constant_seed")
    _run(tmp_path / "bad", "train.steps=2", "rollout.mode=async")
    rows = _jsonl(tmp_path / "bad" / "run" / "metrics.jsonl")
    assert all(r["rollout/identical_group_frac"] == 1.0 for r in rows)
    fired = [e for e in _jsonl(tmp_path / "bad" / "run" / "events.jsonl") if e["kind"] == "identical_samples"]
    assert len(fired) == 2 and all(e["cause"] == "seeding" for e in fired)


def _measured_batch_s(run: Path) -> float:
    return max(r["rollout/gen_s"] + r["rollout/score_s"] for r in _jsonl(run / "metrics.jsonl"))


@pytest.mark.parametrize("fault, says", [("die@2", "exited with code 3"),
                                         ("garbage@2", "returned a malformed batch for step 2: completion_ids"),
                                         ("hang@2", "sent nothing for")])
def test_worker_fault_is_named_and_the_run_stops_with_a_checkpoint(tmp_path, monkeypatch, async_s0, fault, says):
    # Only the hang must trip rollout.timeout_s; the other faults keep the default (600 s), so a
    # healthy batch slowed by load can never be taken for a hang. The hang's limit: 20 x a
    # measured healthy batch, at least 30 s (a tiny batch stalled by a busy machine is not one).
    timeout = max(30.0, 20 * _measured_batch_s(async_s0)) if fault.startswith("hang") else 600.0
    monkeypatch.setenv(FAULT_ENV, fault)
    with pytest.raises(TrainingStopped) as info:
        _run(tmp_path, "train.steps=4", "rollout.mode=async", f"rollout.timeout_s={timeout}")
    message = str(info.value)
    assert "\n" not in message and "rollout worker (pid" in message and says in message, message
    assert info.value.tensor_name == "rollout_worker"
    assert info.value.checkpoint is not None and info.value.checkpoint.name == "step-000001"
    assert not children(os.getpid()), "the worker outlived the run"
    assert not (tmp_path / "run" / "async_weights").exists()


def failing_reward(prompt, completion, answer):
    """Loaded by name in the worker process (the test puts this directory on its path)."""
    raise ZeroDivisionError("a reward that fails")


def test_a_reward_failing_in_the_worker_stops_the_run_naming_the_reward(tmp_path, monkeypatch):
    # This module is the reward's: the worker imports it, and with it tests/ (proc_tree).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(TrainingStopped) as info:
        _run(tmp_path, "train.steps=2", "rollout.mode=async", "rewards=[{name: 'test_async_rollout:failing_reward'}]")
    assert info.value.tensor_name == "reward"
    assert "test_async_rollout:failing_reward" in str(info.value) and "in the rollout worker" in str(info.value)
    assert "\n" not in str(info.value) and info.value.checkpoint.name == "step-000000"
    assert not children(os.getpid())


def test_a_batch_older_than_max_staleness_is_dropped_and_regenerated(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "stale@2")
    _run(tmp_path, "train.steps=3", "rollout.mode=async")
    dropped = [e for e in _jsonl(tmp_path / "run" / "events.jsonl") if e["kind"] == "stale_batch_dropped"]
    assert [(e["step"], e["value"]) for e in dropped] == [(2, 11)]
    rows = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["rollout/staleness_max"] <= 1


@pytest.mark.compares_runs
def test_async_with_lora_samples_the_merged_adapter_of_each_version(tmp_path, monkeypatch):
    """model.lora: the worker's plain model gets W + scaling * B @ A of every published
    version (portarl.trainer.asynchronous.weights); its behaviour log-probs are the LoRA model's
    of that version, which the adapter has moved measurably away from version 0's."""
    pytest.importorskip("peft")
    from async_capture import behaviour_gap, capture_async
    from portarl.parity.tolerances import ROLLOUT_FP32_ATOL

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    snapshots, batches = capture_async(monkeypatch)
    trainer = _run(tmp_path, "rollout.mode=async", "rollout.max_staleness=0", "model.lora.r=4", "optim.lr=5e-2",
                   "rewards=[{name: 'trainer_fast:varied_reward'}]")
    assert [(s, v) for s, v, _ in batches] == [(1, 0), (2, 1), (3, 2)]
    # the versions published (and compared with the worker's log-probs) moved by training
    run_guard.assert_trained(run_guard.grad_norms(tmp_path / "run"), snapshots[0], snapshots[max(snapshots)],
                             what="the published LoRA versions")
    for step, version, rollout in batches:
        gap = behaviour_gap(trainer, snapshots[version], rollout)
        assert gap < ROLLOUT_FP32_ATOL, f"step {step}: not the LoRA model of version {version}"
        if version > 0:  # the check can fail: without the adapter the log-probs are measurably off
            gap = behaviour_gap(trainer, snapshots[0], rollout)
            assert gap > ROLLOUT_FP32_ATOL, f"step {step}: version 0 indistinguishable"
    rows = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(r["mismatch/abs_diff_max"] < ROLLOUT_FP32_ATOL and r["skipped"] == 0 for r in rows)
    assert not children(os.getpid())


def test_config_refuses_what_async_cannot_do():
    TrainConfig.load(None, ["rollout.mode=async", "rollout.engine=vllm"])  # the vLLM worker: tests/vllm_engine
    for setting in ("rollout.sleep_level=1", "rollout.vllm_sleep_mode=true"):  # the former spelling maps to it
        with pytest.raises(ConfigError, match="rollout.sleep_level .*async mode the worker's vLLM generates"):
            TrainConfig.load(None, ["rollout.mode=async", "rollout.engine=vllm", setting])
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling .*not implemented in async mode"):
        TrainConfig.load(None, ["rollout.mode=async", "rollout.dynamic_sampling=true"])
    with pytest.raises(ConfigError, match="rollout.mode"):
        TrainConfig.load(None, ["rollout.mode=later"])
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        TrainConfig.load(None, ["rollout.mode=async", "rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match="rollout.timeout_s"):
        TrainConfig.load(None, ["rollout.timeout_s=0"])


def test_several_ranks_take_vllm_in_either_mode():
    from portarl.trainer.start.setup import check_distributed_config

    vllm = ["train.sft_warmup_steps=0", "rollout.engine=vllm"]
    check_distributed_config(TrainConfig.load(None, [*vllm, "rollout.mode=async"]), 2)  # one worker runs vLLM
    check_distributed_config(TrainConfig.load(None, vllm), 2)  # colocated: an engine per rank (tests/vllm_engine)


def test_async_vllm_without_vllm_is_refused_before_the_worker_starts(tmp_path):
    """The vLLM worker itself runs in tests/vllm_engine (`make test-vllm`); here vLLM is absent."""
    from portarl.rollout.vllm import vllm_unavailable_reason

    if vllm_unavailable_reason() is None:
        pytest.skip("vLLM is installed: tests/vllm_engine/test_vllm_async.py runs the vLLM worker")
    cfg = fast_config(tmp_path, "train.steps=1", "rollout.mode=async", "rollout.engine=vllm")
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    with pytest.raises(ValueError, match="rollout.engine=vllm with rollout.mode=async: .*vLLM is not importable"):
        trainer.train(overwrite=True)
    assert not children(os.getpid())


def test_validate_batch_names_what_is_wrong():
    good = {"prompt_ids": [[1]] * 2, "completion_ids": [[2, 3], [4]], "logprobs": [[-1.0, -2.0], [-0.5]],
            "finished": [True, False], "texts": ["a", "b"], "seeds": [1, 2], "total": [0.0, 1.0],
            "per_function": {"r": [0.0, 1.0]}, "reward_metrics": {"reward/r": 0.5}, "version": 0, "gen_s": 0.1,
            "score_s": 0.0, "idle_s": 0.0, "cpu_s": 0.1}
    rollout, scores = validate_batch(good, 1, 2, "worker")
    assert rollout.completion_ids == [[2, 3], [4]] and scores.total.tolist() == [0.0, 1.0]
    for key, value, says in (("logprobs", [[-1.0], [-0.5]], "sample 0 has 2 tokens and 1 log-probs"),
                             ("total", ["x", 1.0], "reward total"), ("seeds", [1], "seeds has 1 rows, expected 2"),
                             ("version", None, "version")):
        with pytest.raises(RolloutWorkerError, match=says):
            validate_batch({**good, key: value}, 1, 2, "worker")


# ------------------------------------------------------------- the CLI: signals, kill -9
def _start(out: Path, *sets: str, resume: bool = False, **env_extra: str) -> subprocess.Popen:
    """The CLI in its own session (its own process group, as a shell runs a foreground job)."""
    cmd = [sys.executable, "-m", "portarl", "train", "--device", "cpu", "--output-dir", str(out)]
    cmd += ["--resume"] if resume else []
    for item in (*FAST, "rollout.mode=async", *sets):
        cmd += ["--set", item]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath()}  # VARIED finds trainer_fast
    env.pop(FAULT_ENV, None)
    env.update(env_extra)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_rows(proc, out: Path, n: int) -> None:
    limit = time.monotonic() + 600  # bounds a test that has already failed; progress is polled
    while len(_jsonl(out / "metrics.jsonl")) < n:
        assert proc.poll() is None and time.monotonic() < limit, "training did not get there"
        time.sleep(0.05)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_stops_trainer_and_worker(tmp_path, sig, code):
    """SIGTERM to the trainer (a scheduler), SIGINT to its process group (Ctrl-C in a shell)."""
    proc = _start(tmp_path, "train.steps=400", "checkpoint.every=1000")
    try:
        _wait_rows(proc, tmp_path, 2)
        workers = children(supervised(proc.pid))  # the trainer's children
        assert len(workers) == 1
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == code, err[-3000:]
    assert "checkpoint saved" in err and "Traceback" not in err
    assert not alive(workers[0]), "the rollout worker outlived the trainer"


@pytest.mark.compares_runs
def test_kill_9_then_resume_trains_every_step_and_prompt_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _pythonpath())
    sets = ("train.steps=6", "checkpoint.every=3", VARIED)
    _run(tmp_path / "whole", *sets, "rollout.mode=async")  # uninterrupted

    # The worker holds step 5's batch, so the trainer is certainly mid-run when it is killed.
    out = tmp_path / "killed"
    proc = _start(out, *sets, **{FAULT_ENV: "hang@5"})
    try:
        _wait_rows(proc, out, 4)
        workers = children(supervised(proc.pid))  # the trainer's children
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    limit = time.monotonic() + 600
    while alive(workers[0]):  # PR_SET_PDEATHSIG: the worker dies with the trainer
        assert time.monotonic() < limit, "the rollout worker outlived a kill -9 of the trainer"
        time.sleep(0.05)
    resumed = _start(out, *sets, resume=True)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]

    def trained(run: Path) -> list[tuple[int, int]]:
        return sorted((row["step"], p) for row in _jsonl(run / BATCH_LOG) for p in row["prompts"])

    run_guard.assert_run_trained(tmp_path / "whole" / "run", what="the uninterrupted run")
    run_guard.assert_run_trained(out, what="the killed and resumed run")
    assert trained(out) == trained(tmp_path / "whole" / "run")
    assert [r["step"] for r in _jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in _jsonl(out / BATCH_LOG)] == [1, 2, 3, 4, 5, 6]
