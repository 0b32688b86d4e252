"""What the runs say: where each parts from the baseline, and why that is believable.

Curves: a run *parts* at the first step where a metric leaves the band
``max(threshold x max(typical size, rounding floor), noise floor, rounding floor)``.
The rounding floor is the absolute difference one rounding in the coarser of the two runs'
compute dtypes can make to the metric: ``2 x unit roundoff x term scale``, where the term
scale is the size of the per-token terms the metric averages (the largest |advantage| for the
policy loss, whose terms cancel to ~0 by group normalisation; the metric's own largest
magnitude for the others, which average terms of one sign). Without it a metric whose
baseline is 0 (the step-1 policy loss) has a typical size of 0, ``threshold x 0`` is 0, and
the verdict turns on last-bit noise whatever ``--threshold`` says; with it a huge threshold
can never be beaten by a zero typical size. The noise floor is measured, not assumed:
with ``--noise-floor`` the baseline setting is trained again with another seed, and the
largest gap between the two is the run-to-run noise of that metric (a 6% KL gap inside it
is not a parting). Skipped (non-finite) steps, non-finite metrics, and steps a run never
reached (stopped, crashed) count as diverged and are named: leaving them out is how a run
with 29 of 30 steps skipped used to "track the baseline within 10%".

Tokens: runs fed the same recorded rollouts score identical token sequences, so their
per-token old log-probs compare directly: max and mean |d logp|, the k3 KL between them,
and the gap in gradient norm, per step. This shows a device difference before any curve
parts; the report names the first step where mean |d logp| exceeds the bf16 rounding level
(more than twice the mean |d logp| that rounding the baseline's log-probs to bf16 once
causes: a run whose only difference is one bf16 rounding of its outputs sits at 1x). A replaying run drifts off the policy that
sampled the rollouts; the step where its rollout-vs-trainer |d logp| grows well past its
step-1 value marks where differences come from the replay itself, not only numerics.

Each run also carries its mean relative loss gap to the baseline (:mod:`.loss_gap`), the
Ascend community's acceptance number; it is reported, and does not change the verdict.
"""

from __future__ import annotations

import math
import statistics

import torch

from portarl.bench.stability.loss_gap import ASCEND_LOSS_GAP_LIMIT, mean_relative_loss_gap
from portarl.bench.stability.record import RunResult, step_ranges
from portarl.bench.stability.runs import METRICS

BF16_ULP = 2.0 ** -8
UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}  # half an ulp at 1
# Metrics whose per-token terms cancel (group-normalised advantages sum to 0 in every group),
# so their own size says nothing of the size of the terms: the term scale comes from this row key.
TERM_SCALE_KEYS = {"pg/loss": "adv/adv_abs_max"}
ROUNDING_MARGIN = 2.0  # "above the bf16 rounding level": more than twice what one rounding causes
OFF_POLICY_FACTOR = 4.0  # x the step-1 rollout-vs-trainer |d logp|
OFF_POLICY_FLOOR = BF16_ULP / 8  # below this the rollouts are on-policy whatever step 1 was
CURVE_METRICS = [key for key, _ in METRICS if not key.startswith("mismatch/")]


def typical_scale(values: list[float]) -> float:
    """Median magnitude, or the spread for metrics that hover around 0 (the policy loss of
    group-normalised advantages); 0.0 when the baseline has no usable scale (all 0)."""
    if not values:
        return 0.0
    spread = statistics.pstdev(values) if len(values) > 1 else 0.0
    return max(statistics.median(abs(v) for v in values), spread)


def _max_abs(rows: list[dict], key: str) -> float:
    vals = [abs(float(r[key])) for r in rows if _finite(r.get(key))]
    return max(vals, default=0.0)


def rounding_floor(base: RunResult, other: RunResult, key: str) -> float:
    """``2 x u x term scale``: the largest gap one rounding in the coarser compute dtype of the
    two runs explains (u from :data:`UNIT_ROUNDOFF`; term scale from the data of both runs)."""
    u = max(UNIT_ROUNDOFF.get(base.spec.dtype, UNIT_ROUNDOFF["fp32"]),
            UNIT_ROUNDOFF.get(other.spec.dtype, UNIT_ROUNDOFF["fp32"]))
    scale_key = TERM_SCALE_KEYS.get(key, key)
    scale = max(_max_abs(base.rows, scale_key), _max_abs(other.rows, scale_key))
    if scale == 0.0 and scale_key != key:  # the term-scale key was not logged: the metric's own size
        scale = max(_max_abs(base.rows, key), _max_abs(other.rows, key))
    return ROUNDING_MARGIN * u * scale


def parting_limit(base: RunResult, other: RunResult, key: str, threshold: float, band: float = 0.0) -> dict:
    """The band a metric must leave to part, with its parts (reported per metric)."""
    typical = typical_scale([v for _, v in base.series(key)])
    floor = rounding_floor(base, other, key)
    usable = typical > floor
    limit = max(threshold * max(typical, floor), band, floor)
    return {"limit": limit, "typical": typical, "rounding_floor": floor, "noise_floor": band, "usable_scale": usable}


def noise_band(base: RunResult, noise: RunResult, key: str) -> float:
    a, b = dict(base.series(key)), dict(noise.series(key))
    gaps = [abs(a[s] - b[s]) for s in set(a) & set(b)]
    return max(gaps) if gaps else 0.0


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(float(v))


def first_divergence(base: RunResult, other: RunResult, key: str, threshold: float,
                     band: float = 0.0) -> tuple[int, str] | None:
    """``(step, why)`` of the first step ``other`` parts from ``base`` on ``key``, or None.

    why: ``key`` (left the band), ``skipped``, ``non-finite`` or ``missing`` (never reached)."""
    a = {r["step"]: r for r in base.rows}
    b = {r["step"]: r for r in other.rows}
    limit = parting_limit(base, other, key, threshold, band)["limit"]
    for step in sorted(set(a) | set(range(1, (base.steps or max(a, default=0)) + 1))):
        ra, rb = a.get(step), b.get(step)
        if ra is not None and ra.get("skipped"):
            continue  # the baseline has nothing to compare at this step
        if rb is None:
            return step, "missing"
        if rb.get("skipped"):
            return step, "skipped"
        va, vb = (ra or {}).get(key), rb.get(key)
        if not _finite(va):
            continue
        if not _finite(vb):
            return step, "non-finite"
        if abs(float(va) - float(vb)) > limit:
            return step, key
    return None


def threshold_text(threshold: float) -> str:
    """``10%`` for a fraction, ``1e+09x its typical size`` for a factor (no 100000000000%)."""
    return f"{threshold:.0%}" if threshold < 10 else f"{threshold:g}x"


def token_divergence(base: RunResult, run: RunResult) -> list[dict] | None:
    """Per step, between two runs that trained on the same recorded rollouts."""
    sha = base.rollouts.get("sha256")
    if not sha or sha != run.rollouts.get("sha256") or not base.tokens or not run.tokens:
        return None
    rows = []
    for step in sorted(set(base.tokens) & set(run.tokens)):
        a, b = base.tokens[step], run.tokens[step]
        if a["old_logp"].shape != b["old_logp"].shape or a["old_logp"].numel() == 0:
            continue
        d = b["old_logp"].double() - a["old_logp"].double()
        ga, gb = base.value(step, "grad_norm"), run.value(step, "grad_norm")
        rows.append({
            "step": step,
            "max_abs_dlogp": float(d.abs().max()),
            "mean_abs_dlogp": float(d.abs().mean()),
            "k3_kl": float((torch.exp(d) - 1 - d).mean()),  # KL(base || run) on the base's tokens
            "entropy_mean_abs_diff": float((b["entropy"].double() - a["entropy"].double()).abs().mean()),
            "grad_norm_diff": abs(gb - ga) if ga is not None and gb is not None else float("nan"),
            "bf16_level": bf16_rounding_level(a["old_logp"]),
        })
    return rows


def bf16_rounding_level(logp: torch.Tensor) -> float:
    """Mean |d logp| that rounding these log-probs to bf16 once would cause: two runs that
    differ by more did more than round one bf16 result."""
    return float((logp.to(torch.bfloat16).double() - logp.double()).abs().mean())


def off_policy(run: RunResult) -> tuple[list[tuple[int, float]], int | None]:
    """Per step mean |rollout logp - trainer old logp|, and the step it turns far off-policy."""
    series = [(s, float((t["rollout_logp"].double() - t["old_logp"].double()).abs().mean()))
              for s, t in sorted(run.tokens.items()) if t["old_logp"].numel()]
    if not series:
        return series, None
    limit = OFF_POLICY_FACTOR * max(series[0][1], OFF_POLICY_FLOOR)
    return series, next((s for s, v in series if not v <= limit), None)


def _run_entry(r: RunResult, base: RunResult, threshold: float, bands: dict | None) -> dict:
    is_base = r is base
    parts, limits = {}, {}
    for key in CURVE_METRICS:
        band = (bands or {}).get(key, 0.0)
        hit = None if is_base else first_divergence(base, r, key, threshold, band)
        parts[key] = hit
        if not is_base:
            limits[key] = parting_limit(base, r, key, threshold, band)
    hits = [(v[0], k, v[1]) for k, v in parts.items() if v is not None]
    first = min(hits) if hits else None
    if r.crashed and not is_base:
        first = first or (1, "crash", "missing")
    kl_spikes, grad_spikes = r.spikes("kl_spike"), r.spikes("grad_norm_spike")
    reward = [v for _, v in r.series("reward/mean")]
    final = statistics.mean(reward[-10:]) if reward else float("nan")
    tag = " [EMULATION]" if r.spec.emulated else ""
    name = f"{r.label}{tag}"
    band_text = "its measured noise floor" if bands else f"{threshold_text(threshold)} (no noise floor measured)"
    if is_base:
        verdict = f"{name}: baseline"
    elif r.spec.role == "noise":
        verdict = f"{name}: noise floor (the baseline setting with another seed)"
    elif first is None:
        verdict = f"{name}: tracks {base.label} within {band_text} on every metric"
    else:
        why = first[2] if first[2] in ("skipped", "non-finite", "missing") else first[1]
        verdict = f"{name}: PARTS from {base.label} at step {first[0]} ({why}; beyond {band_text})"
    skipped = r.nan_steps
    if skipped:
        bad = sorted({row.get("guard/nonfinite_tensor") for row in r.rows if row.get("skipped")} - {None})
        verdict += (f"; skipped (non-finite) steps {step_ranges(skipped)} ({len(skipped)} of {r.steps or len(r.rows)}, "
                    f"counted as diverged; first bad tensor: {', '.join(bad) or '?'})")
    verdict += (f"; {len(kl_spikes)} KL spike(s), {len(grad_spikes)} grad-norm spike(s); final reward {final:.3f}")
    unscaled = [k for k, v in limits.items() if not v["usable_scale"] and base.series(k)]
    if unscaled and r.spec.role != "noise":
        verdict += (f"; no usable scale in the baseline for {', '.join(unscaled)} (typical size at or below the "
                    "rounding floor): judged against the rounding floor")
    if r.crashed:
        verdict += f"; CRASHED: {r.crashed}"
    if r.stopped:
        verdict += f"; STOPPED: {r.stopped}"
    mismatch = [v for _, v in r.series("mismatch/abs_diff_mean")]
    return {
        "label": r.label, "role": r.spec.role, "emulated": r.spec.emulated, "device_name": r.device_name,
        "environment": r.environment, "source": r.source, "rollouts": r.rollouts,
        "first_divergence": {k: (v[0] if v else None) for k, v in parts.items()},
        "parted": None if first is None or is_base or r.spec.role == "noise" else {"step": first[0], "metric": first[1], "why": first[2]},
        "kl_spikes": kl_spikes, "grad_norm_spikes": grad_spikes, "nan_steps": skipped, "stopped": r.stopped,
        "crashed": r.crashed, "final_reward": final, "verdict": verdict, "limits": limits,
        "mean_abs_dlogp": statistics.mean(mismatch) if mismatch else float("nan"),
    }


def analyse(results: list[RunResult], threshold: float) -> dict:
    runs = [r for r in results if r.spec.role != "noise"]
    if not runs:
        raise ValueError("no runs to compare (only noise-floor repeats)")
    base = runs[0]
    noise = next((r for r in results if r.spec.role == "noise"), None)
    bands = {key: noise_band(base, noise, key) for key in CURVE_METRICS} if noise is not None else None
    entries = [_run_entry(r, base, threshold, bands) for r in results]
    for r, entry in zip(results, entries):  # the Ascend acceptance number; not part of the verdict
        entry["loss_gap"] = None if r is base else mean_relative_loss_gap(base, r)
    replay = any(r.rollouts.get("mode") == "replayed" for r in results)
    tokens = {}
    for r, entry in zip(results, entries):
        rows = None if r is base else token_divergence(base, r)
        series, far = off_policy(r) if r.rollouts.get("mode") == "replayed" else ([], None)
        entry["off_policy_from"] = far
        entry["rollout_vs_trainer_dlogp"] = series
        if rows:
            tokens[r.label] = rows
            above = next((t["step"] for t in rows if t["mean_abs_dlogp"] > ROUNDING_MARGIN * t["bf16_level"]), None)
            entry["tokens"] = {"first_above_bf16": above, "max_abs_dlogp": max(t["max_abs_dlogp"] for t in rows),
                               "steps": len(rows)}
            where = f"step {above}" if above is not None else "no step"
            entry["verdict"] += (f"; token level: mean |d logp| above the bf16 rounding level at {where}"
                                 + (f" (curves part at step {entry['parted']['step']})" if entry["parted"] else ""))
        if far is not None:
            entry["verdict"] += f"; replayed rollouts far off-policy from step {far}"
    return {"baseline": base.label, "threshold": threshold, "replay_rollouts": replay, "noise_floor": bands,
            "runs": entries, "tokens": tokens,
            "parted": [e["label"] for e in entries if e["parted"] is not None],
            "loss_gap_limit": ASCEND_LOSS_GAP_LIMIT,
            "loss_gap_failed": [e["label"] for e in entries if e["loss_gap"] and e["loss_gap"]["passes"] is False]}
