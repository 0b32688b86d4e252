"""A reward that exits, interrupts, hangs or returns NaN stops the run the documented way:
a checkpoint of the last finished step, one line naming the reward, the sample and its
prompt, exit 3; a SIGTERM while a reward hangs still saves and exits 143 (issue 33 items 1,
2, 11, 13). The real CLI in a subprocess: what is checked is what a scheduler sees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from portarl.trainer.checkpoint import CheckpointManager
from portarl.trainer.checkpoint import manifest as mf

import run_guard
from trainer_fast import FAST

HERE = Path(__file__).parent
#: Step 1 scores 4 prompts x 4 samples; the reward misbehaves from the 17th call on (step 2).
STEP_CALLS = 16


def _command(out: Path, reward: str, *sets: str, resume: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "portarl", "train", "--device", "cpu", "--output-dir", str(out)]
    for item in (*FAST, "checkpoint.every=100", f"rewards=[{{name: 'faulty_rewards:{reward}'}}]", *sets):
        cmd += ["--set", item]
    return cmd + (["--resume"] if resume else [])


def _env(**extra: str) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **extra}
    env.pop("TRITON_INTERPRET", None)
    return env


def _run(out: Path, reward: str, *sets: str, resume: bool = False, **env) -> subprocess.CompletedProcess:
    return subprocess.run(_command(out, reward, *sets, resume=resume), env=_env(**env), capture_output=True, text=True,
                          timeout=900)


def _portarl_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("portarl train: stopping")]


def _checkpoint_step(out: Path) -> int:
    latest = CheckpointManager(out).latest()
    mf.verify(latest)
    return CheckpointManager.load_state(latest)["step"]


@pytest.mark.parametrize("reward, problem", [
    ("exits_0", "called sys.exit(0)"),
    ("exits_1", "called sys.exit(1)"),
    ("keyboard_interrupt", "raised KeyboardInterrupt"),
    ("base_exception", "raised OddBase: from a reward"),
])
def test_a_reward_that_exits_stops_with_a_checkpoint_and_exit_3(tmp_path, reward, problem):
    done = _run(tmp_path, reward, FAULT_AFTER=str(STEP_CALLS))
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    [line] = _portarl_lines(done.stderr)
    assert line.startswith(f"portarl train: stopping at step 2: reward 'faulty_rewards:{reward}' {problem} on "
                           "sample 0 (prompt '"), line
    assert "Checkpoint of step 1:" in line
    assert _checkpoint_step(tmp_path) == 1
    assert [json.loads(r)["step"] for r in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_a_hanging_reward_is_named_after_its_time_limit(tmp_path, mode):
    """In async mode the worker process scores, under the same guard: the reward is named
    before the trainer's rollout.timeout_s would call the worker hung."""
    done = _run(tmp_path, "hangs", "train.reward_timeout_s=2", f"rollout.mode={mode}", FAULT_AFTER=str(STEP_CALLS))
    assert done.returncode == 3, done.stderr[-3000:]
    [line] = _portarl_lines(done.stderr)
    assert ("reward 'faulty_rewards:hangs' did not return within train.reward_timeout_s=2 s" in line
            and "on sample 0 (prompt '" in line and "Checkpoint of step 1:" in line), line
    assert _checkpoint_step(tmp_path) == 1


def _final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(CheckpointManager(out).latest() / "model.safetensors"))


@pytest.mark.compares_runs
def test_sigterm_while_a_reward_hangs_saves_exits_143_and_resumes_exactly(tmp_path):
    """The default time limit (300 s) is far away: the signal itself ends the hung call,
    the half-done step 2 is dropped, and resuming gives the uninterrupted run's weights."""
    gate = tmp_path / "gate"
    gate.mkdir()
    out = tmp_path / "interrupted"
    proc = subprocess.Popen(_command(out, "hangs", "train.steps=3"), env=_env(FAULT_AFTER=str(STEP_CALLS),
                            HOLD_DIR=str(gate)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600  # slowed by load, never failed by it
        while not (gate / "holding").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the hang never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM after step 1; checkpoint saved" in err and "Traceback" not in err, err[-3000:]
    assert _checkpoint_step(out) == 1
    resumed = _run(out, "hangs", "train.steps=3", resume=True, FAULT_AFTER="1000000")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = tmp_path / "straight"
    assert _run(straight, "hangs", "train.steps=3", FAULT_AFTER="1000000").returncode == 0
    # the reward scores like trainer_fast.varied_reward until it hangs: the runs compared train
    run_guard.assert_run_trained(straight, what="the uninterrupted run")
    run_guard.assert_run_trained(out, what="the run stopped by SIGTERM and resumed")
    want, got = _final_weights(straight), _final_weights(out)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_hook_that_exits_is_named_too(make_trainer):
    from portarl.trainer import TrainingStopped

    trainer = make_trainer("checkpoint.every=100")

    def quits(step, tensor):
        if step == 2:
            sys.exit(0)
        return tensor

    trainer.hooks["advantage"].append(quits)
    with pytest.raises(TrainingStopped, match=r"stopping at step 2: hook 'quits' at 'advantage' called sys.exit\(0\) "
                                              r"on step 2\. Checkpoint of step 1") as err:
        trainer.train()
    assert err.value.checkpoint.name == "step-000001" and trainer.step == 1


def test_a_hook_failing_after_an_optimizer_step_of_its_iteration_saves_nothing(make_trainer):
    """Two mini-batches: the gradient hook of the second runs after the first optimizer
    step, so the weights belong to no step; the last checkpoint is named instead."""
    from portarl.trainer import TrainingStopped

    trainer = make_trainer("checkpoint.every=1", "train.mini_batches=2")
    calls = []

    def breaks(step, grad):
        calls.append(step)
        if len(calls) == 4:  # step 2, second mini-batch
            raise KeyboardInterrupt
        return grad

    trainer.hooks["grad"].append(breaks)
    with pytest.raises(TrainingStopped, match=r"hook 'breaks' at 'grad' raised KeyboardInterrupt on step 2\. step 2 was "
                                              r"partly applied, so it is not saved; last checkpoint: .*step-000001"):
        trainer.train()
    assert CheckpointManager(trainer.output_dir).latest().name == "step-000001"


def test_a_reward_with_the_wrong_signature_says_what_it_takes_and_what_portarl_passes(tmp_path):
    done = _run(tmp_path, "two_args")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == ["portarl train: reward 'faulty_rewards:two_args' has the wrong signature for fn(prompt, "
                     "completion, answer): it takes 2 arguments (prompt, completion), portarl passes 3: (prompt, "
                     "completion, answer)"], done.stderr


@pytest.mark.parametrize("steps, good_calls, failing_step", [(1, 5, 1), (3, STEP_CALLS + 5, 2)])
def test_a_nan_reward_is_named_at_its_first_occurrence_even_in_a_short_run(tmp_path, steps, good_calls, failing_step):
    """A short run used to skip every step (a non-finite reward skips the step) and exit 0."""
    done = _run(tmp_path, "nan", f"train.steps={steps}", FAULT_AFTER=str(good_calls))
    assert done.returncode == 3, done.stderr[-3000:]
    [line] = _portarl_lines(done.stderr)
    assert line.startswith(f"portarl train: stopping at step {failing_step}: reward 'faulty_rewards:nan' returned nan, "
                           "expected a finite number on sample 5 (prompt '"), line
    assert f"Checkpoint of step {failing_step - 1}:" in line
