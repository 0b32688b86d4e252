"""The mean relative loss gap between a run and the baseline: the number the Ascend community
accepts a port on (verl's Ascend page: the loss of the NPU run and of the GPU run, same config,
mean relative error at most 2%; verl PR #332 / OpenRLHF PR #605).

Definition, per run against the baseline::

    gap = mean over compared steps s of |loss_run(s) - loss_base(s)| / |loss_base(s)|

*The loss* is the training loss the trainer reports and back-propagates, the ``loss`` row of
``metrics.jsonl`` (the policy-gradient loss plus the KL-loss term, minus any entropy bonus):
what verl and OpenRLHF log as the step's training loss and what their NPU-vs-GPU comparisons
use. A run directory whose metrics have no ``loss`` row (written before it was logged) falls
back to the policy loss ``pg/loss``; the key used is named in the result.

Which steps count: only steps both runs logged, with a finite loss in both. Steps where
``|loss_base(s)| < LOSS_GAP_FLOOR`` (1e-6: there a last-bit difference is already a relative
gap of 10% or more, and at exactly 0, as when every group of a GRPO step has zero-variance
rewards, the ratio is undefined) are left out and counted. A non-finite (NaN / inf) or
unlogged loss in the run at a step where the baseline's is finite is not averaged away:
``mean_relative_gap`` is then NaN, the steps are named and the run fails the rule (the mean
over its finite steps is kept beside it). Baseline steps with a non-finite loss, and baseline
steps the run never reached (it stopped, or replayed fewer steps), are named, not compared.

GRPO caveat: with group-normalised advantages the policy loss sits near 0 by construction, so
its relative gap is large for small absolute differences; the curve verdicts of
:mod:`.analysis` (noise floor, rounding floor) stay what ``compare``'s exit status rests on.
"""

from __future__ import annotations

import math
import statistics

from portarl.bench.stability.record import RunResult, step_ranges

ASCEND_LOSS_GAP_LIMIT = 0.02  # the Ascend community's acceptance: mean relative loss gap below 2%
ACCEPTANCE_SOURCE = "verl PR #332 / OpenRLHF PR #605"
LOSS_GAP_FLOOR = 1e-6  # |baseline loss| below this: the step is left out (ratio undefined or noise)
LOSS_KEYS = ("loss", "pg/loss")  # the training loss; the policy loss for directories without it


def loss_key(base: RunResult, run: RunResult) -> str | None:
    """The first of :data:`LOSS_KEYS` that both runs logged."""
    for key in LOSS_KEYS:
        if any(key in r for r in base.rows) and any(key in r for r in run.rows):
            return key
    return None


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def mean_relative_loss_gap(base: RunResult, run: RunResult, *, floor: float = LOSS_GAP_FLOOR,
                           limit: float = ASCEND_LOSS_GAP_LIMIT) -> dict:
    """The gap of ``run`` against ``base`` with its accounting (see the module docstring)."""
    key = loss_key(base, run)
    a = {r["step"]: r.get(key) for r in base.rows} if key else {}
    b = {r["step"]: r.get(key) for r in run.rows} if key else {}
    gaps, near_zero, nonfinite, base_nonfinite, missing = [], [], [], [], []
    for step in sorted(a):
        va = a[step]
        if step not in b:
            missing.append(step)
        elif not _finite(va):
            base_nonfinite.append(step)
        elif not _finite(b[step]):
            nonfinite.append(step)
        elif abs(float(va)) < floor:
            near_zero.append(step)
        else:
            gaps.append(abs(float(b[step]) - float(va)) / abs(float(va)))
    finite_mean = statistics.fmean(gaps) if gaps else None
    mean = float("nan") if nonfinite else finite_mean
    passes = None if key is None or (mean is None and not nonfinite) else bool(not nonfinite and mean < limit)
    result = {
        "metric": key, "mean_relative_gap": mean, "mean_relative_gap_finite_steps": finite_mean,
        "steps_compared": len(gaps), "near_zero_floor": floor, "near_zero_steps": near_zero,
        "nonfinite_steps": nonfinite, "baseline_nonfinite_steps": base_nonfinite, "missing_steps": missing,
        "limit": limit, "passes": passes,
    }
    result["line"] = gap_line(result)
    return result


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def gap_line(g: dict) -> str:
    """``mean relative loss gap 0.84% over 30 steps (Ascend community acceptance: < 2%, ...): passes``."""
    rule = f"(Ascend community acceptance: < {_pct(g['limit'])}, {ACCEPTANCE_SOURCE})"
    if g["metric"] is None:
        return f"mean relative loss gap: no loss logged by both runs {rule}: not judged"
    name = "mean relative loss gap" + ("" if g["metric"] == "loss" else f" ({g['metric']})")
    n = g["steps_compared"]
    if g["nonfinite_steps"]:
        bad = g["nonfinite_steps"]
        text = (f"{name} non-finite over {n + len(bad)} steps {rule}: FAILS (loss NaN/inf or not logged in the run "
                f"at step{'s' if len(bad) > 1 else ''} {step_ranges(bad)}; over the {n} finite steps: "
                + (_pct(g["mean_relative_gap_finite_steps"]) if n else "-") + ")")
    elif g["mean_relative_gap"] is None:
        text = f"{name}: no step to compare {rule}: not judged"
    else:
        text = (f"{name} {_pct(g['mean_relative_gap'])} over {n} step{'s' if n != 1 else ''} {rule}: "
                + ("passes" if g["passes"] else "FAILS"))
    notes = []
    if g["near_zero_steps"]:
        k = len(g["near_zero_steps"])
        notes.append(f"{k} step{'s' if k > 1 else ''} with |baseline loss| < {g['near_zero_floor']:g} left out "
                     f"({step_ranges(g['near_zero_steps'])})")
    if g["baseline_nonfinite_steps"]:
        notes.append(f"baseline loss non-finite at steps {step_ranges(g['baseline_nonfinite_steps'])} (not compared)")
    if g["missing_steps"]:
        notes.append(f"steps {step_ranges(g['missing_steps'])} not reached by the run (not compared)")
    return text + "".join(f"; {n}" for n in notes)
