"""What the vLLM tests that compare the engine with the trainer across steps share (issue 58):
a reward with spread within groups, and the guard on the optimizer step whose weights the
next rollout's sync carries.

The config's default rewards (math_exact, format) give 0 to every sample of an untrained
tiny model: every advantage and gradient is 0, the weights synced after a step are those the
engine already holds, and "vLLM's log-probs equal the trainer's after every sync" holds for
an engine whose sync loads nothing. ``trainer_fast:varied_reward`` (tests/trainer) differs
between the samples of a group from the first step on."""

from __future__ import annotations

import os
from pathlib import Path

import run_guard

TRAINER_TESTS = Path(__file__).resolve().parents[1] / "trainer"
#: A ``--set`` / override item: the reward with spread within groups.
SPREAD = "rewards=[{name: 'trainer_fast:varied_reward'}]"


def checkpoints(steps: int) -> list[str]:
    """A checkpoint after every step, all kept (the guard reads the one after step 1)."""
    return ["checkpoint.every=1", f"checkpoint.keep_last={steps}"]


def pythonpath(*extra: Path | str) -> str:
    """``PYTHONPATH`` for a run in another process that imports ``trainer_fast`` (and ``extra``)."""
    return os.pathsep.join([*map(str, extra), str(TRAINER_TESTS), os.environ.get("PYTHONPATH", "")])


def spread_reward(monkeypatch) -> str:
    """``trainer_fast:varied_reward`` importable in this process and in the processes it
    starts (the async rollout worker, the harness's runs); returns :data:`SPREAD`."""
    monkeypatch.syspath_prepend(str(TRAINER_TESTS))
    monkeypatch.setenv("PYTHONPATH", pythonpath())
    return SPREAD


def checkpoint_at(run: str | Path, step: int) -> Path:
    return Path(run) / "checkpoints" / f"step-{step:06d}"


def assert_step_1_moved(run: str | Path, what: str, start=None) -> list[str]:
    """The guard on GRPO step 1 of ``run``: a finite grad_norm > 0 and the weights of its
    checkpoint off the run's start (rebuilt from the saved config unless ``start``). The
    rollout of step 2 then runs on weights synced after an optimizer step: they differ from
    those the engine held at step 1 (and from the initial ones)."""
    first = checkpoint_at(run, 1)
    return run_guard.assert_trained(run_guard.grad_norms(run)[:1],
                                    run_guard.start_weights(first) if start is None else start,
                                    run_guard.checkpoint_weights(first), what=what)


def assert_steps_moved(run: str | Path, last: int, what: str) -> None:
    """The guard on steps 1 to ``last`` of ``run`` (a checkpoint after each): step s had a
    grad_norm > 0 and its checkpoint's weights differ from step s - 1's (the start's for
    s = 1), so the sync before step s + 1 carries weights the engine does not hold yet."""
    norms = run_guard.grad_norms(run)
    for step in range(1, last + 1):
        end = checkpoint_at(run, step)
        start = (run_guard.start_weights(end) if step == 1
                 else run_guard.checkpoint_weights(checkpoint_at(run, step - 1)))
        run_guard.assert_trained(norms[step - 1 : step], start, run_guard.checkpoint_weights(end),
                                 what=f"{what}: step {step}")
