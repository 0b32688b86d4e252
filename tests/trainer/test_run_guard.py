"""The guard every comparison of runs goes through (tests/run_guard.py, issue 58): it fails
on a real run whose gradient is 0 (a reward that is the same for every sample: zero
advantages, as an untrained model's 0 on the built-in task gives), on weights that did not
move beside a gradient > 0 (the weights compared are not the trained ones), on non-finite
gradient norms;
it passes on a run that trained. And the rule that keeps it in use: a test whose name says
it compares runs carries ``compares_runs`` (which tests/conftest.py holds to a guard call)
or is listed, with why, in ``run_guard.NOT_RUN_COMPARISONS``."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch

import run_guard
from trainer_fast import varied_reward

TESTS = Path(__file__).resolve().parents[1]


def constant_reward(prompt, completion, answer):
    """The same score for every sample: every group's advantages are 0."""
    return 1.0


def _run(make_trainer, *overrides, rewards):
    trainer = make_trainer("train.steps=2", "checkpoint.every=1", *overrides, rewards=rewards)
    start = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    return trainer.output_dir, start


def test_a_zero_gradient_run_fails_the_guard(make_trainer):
    out, start = _run(make_trainer, rewards=[constant_reward])
    assert run_guard.grad_norms(out) == [0.0, 0.0]  # the premise: zero advantages, zero gradient
    assert not run_guard.moved(start, run_guard.checkpoint_weights(out))
    with pytest.raises(run_guard.NotTrained, match="no step had a finite grad_norm > 0"):
        run_guard.assert_run_trained(out, what="a constant reward")


def test_a_run_that_trained_passes_and_its_rebuilt_start_is_the_models(make_trainer):
    out, start = _run(make_trainer, rewards=[varied_reward])
    rebuilt = run_guard.start_weights(out)
    assert rebuilt.keys() == start.keys() and all(torch.equal(rebuilt[k], start[k]) for k in start)
    assert run_guard.assert_run_trained(out, what="a varied reward")
    # the first checkpoint moved too; against itself (weights that are not the trained ones,
    # a gradient > 0 beside them) it did not
    first = out / "checkpoints" / "step-000001"
    assert run_guard.assert_run_trained(out, end=first)
    with pytest.raises(run_guard.NotTrained, match=r"0 of \d+ tensors moved"):
        run_guard.assert_trained([1.0], run_guard.checkpoint_weights(first), run_guard.checkpoint_weights(first),
                                 what="a checkpoint against itself")


def test_nonfinite_or_missing_gradient_norms_and_zero_gradients_fail():
    w = {"w": torch.zeros(2)}
    for norms in ([], [float("nan")], [float("inf"), 0.0], [None]):
        with pytest.raises(run_guard.NotTrained):
            run_guard.assert_trained(norms, w, {"w": torch.ones(2)}, what=str(norms))
    with pytest.raises(run_guard.NotTrained, match="every gradient is 0"):
        run_guard.assert_gradient_flows([torch.zeros(3), torch.zeros(2)], what="zeros")
    with pytest.raises(run_guard.NotTrained, match="not finite"):
        run_guard.assert_gradient_flows({"a": torch.tensor([math.nan])}, what="nan")
    assert run_guard.assert_gradient_flows([torch.zeros(3), torch.tensor([3.0, 4.0])], what="some") == 5.0


def test_a_marked_test_that_never_calls_the_guard_fails():
    before = len(run_guard.calls)
    with pytest.raises(run_guard.NotTrained, match="marked compares_runs but never called"):
        run_guard.require_guard_called("tests/x.py::test_y", before)
    run_guard.assert_gradient_flows([torch.ones(1)], what="one call")
    run_guard.require_guard_called("tests/x.py::test_y", before)


#: The folders whose tests run the trainer, a worker or an engine.
RUN_FOLDERS = ("trainer", "distributed", "vision", "vllm_engine", "moe", "weight_sync", "bench", "cli")
#: Names that say a test compares runs: across ranks, layouts, thread counts, implementations,
#: a resume against the uninterrupted run, a worker or an engine against the trainer after a sync.
RUN_COMPARISON_NAME = re.compile(
    r"one_process|bitwise|uninterrupted|resum|reproduc|same_(metrics|weights|bits|numbers)|threads"
    r"|equals?_(padded|unshared|colocated|one_micro_batch)|across|agree_on|trains|gradients_equal|weights_equal"
    r"|matches_colocated|after_(each|every)_sync|changes_outputs|just_synced")


def _marked(node: ast.FunctionDef, module: ast.Module) -> bool:
    def names(decorators):
        return {ast.unparse(d) for d in decorators}

    if any("compares_runs" in d for d in names(node.decorator_list)):
        return True
    for stmt in module.body:  # pytestmark = pytest.mark.compares_runs (or a list holding it)
        if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in stmt.targets):
            if "compares_runs" in ast.unparse(stmt.value):
                return True
    return False


def _tests():
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.parent.name not in RUN_FOLDERS:
            continue
        module = ast.parse(path.read_text())
        for node in module.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                yield f"{path.parent.name}/{path.name}::{node.name}", node, module


def test_every_test_named_as_a_comparison_of_runs_is_marked_or_exempted_with_a_reason():
    unmarked, seen = [], set()
    for key, node, module in _tests():
        seen.add(key)
        if RUN_COMPARISON_NAME.search(node.name) and not _marked(node, module) \
                and key not in run_guard.NOT_RUN_COMPARISONS:
            unmarked.append(key)
    stale = sorted(set(run_guard.NOT_RUN_COMPARISONS) - seen)
    assert not unmarked, ("these tests' names say they compare runs: mark them @pytest.mark.compares_runs and call "
                          "run_guard's guard, or list them in run_guard.NOT_RUN_COMPARISONS with the reason:\n"
                          + "\n".join(unmarked))
    assert not stale, f"run_guard lists tests that no longer exist (renamed?): {stale}"
    for key, why in run_guard.NOT_RUN_COMPARISONS.items():
        assert len(why) > 20, f"{key}: say why it compares no runs"
