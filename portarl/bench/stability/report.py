"""The report: ``report.md`` (verdicts, tables, environments), ``stability.png`` (curves)
and ``tokens.png`` (token-level divergence between runs fed the same rollouts)."""

from __future__ import annotations

from pathlib import Path

from portarl.bench.stability.analysis import threshold_text
from portarl.bench.stability.loss_gap import ACCEPTANCE_SOURCE
from portarl.bench.stability.record import RunResult
from portarl.bench.stability.runs import METRICS


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(results: list[RunResult], path: Path) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 4, figsize=(19, 7))
    for ax, (key, title) in zip(axes.flat, METRICS):
        for r in results:
            pts = r.series(key)
            label = r.label + (" (emulated)" if r.spec.emulated else "")
            if pts:
                line, = ax.plot(*zip(*pts), label=label, linewidth=1.2)
                marks = {"kl": r.spikes("kl_spike"), "grad_norm": r.spikes("grad_norm_spike")}.get(key, [])
                lookup = dict(pts)
                xs = [s for s in marks if s in lookup]
                if xs:
                    ax.scatter(xs, [lookup[s] for s in xs], marker="x", s=40, color=line.get_color(), zorder=3)
            for s in r.nan_steps:
                ax.axvline(s, color="red", alpha=0.3, linewidth=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("x: spike events (trainer detector); red lines: skipped (non-finite) steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_tokens(analysis: dict, path: Path) -> Path | None:
    """Per step, each run against the baseline on identical tokens."""
    plt = _pyplot()
    if plt is None or not analysis["tokens"]:
        return None
    panels = (("max_abs_dlogp", "max |d logp| vs baseline"), ("mean_abs_dlogp", "mean |d logp| vs baseline"),
              ("k3_kl", "k3 KL(baseline || run)"), ("grad_norm_diff", "|d grad norm|"))
    fig, axes = plt.subplots(1, 5, figsize=(23, 4))
    for ax, (key, title) in zip(axes, panels):
        for label, rows in analysis["tokens"].items():
            pts = [(t["step"], max(t[key], 1e-12)) for t in rows if t[key] == t[key]]
            if pts:
                ax.plot(*zip(*pts), label=label, linewidth=1.2, marker=".")
            if key == "mean_abs_dlogp":
                ax.plot([t["step"] for t in rows], [t["bf16_level"] for t in rows], "k--", linewidth=0.8,
                        label="bf16 rounding level" if label == next(iter(analysis["tokens"])) else None)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
    ax = axes[-1]
    for run in analysis["runs"]:
        if run["rollout_vs_trainer_dlogp"]:
            line, = ax.plot(*zip(*run["rollout_vs_trainer_dlogp"]), label=run["label"], linewidth=1.2)
            if run["off_policy_from"] is not None:
                ax.axvline(run["off_policy_from"], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.set_title("|d logp| rollout vs trainer (dotted: off-policy)")
    ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.suptitle("same recorded tokens scored by each run: where the devices' numerics part, before the curves do",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _switches(e: dict) -> str:
    """The run's numerics switches that were on, and any an engine changed that were set back."""
    on = [name for name, value in (e.get("precision_switches") or {}).items() if value is True]
    restored = [f"{r['switch']} (set to {r['changed_to']} by {r['by']})" for r in e.get("precision_switches_restored") or []]
    text = ", ".join(on) or ("none on" if "precision_switches" in e else "-")
    return text + (f"; set back: {', '.join(restored)}" if restored else "")


def _env_row(run: dict) -> str:
    e = run.get("environment") or {}
    driver = e.get("nvidia_driver") or e.get("npu_driver") or "-"
    return (f"| {run['label']} | {e.get('device_name', run['device_name'])} | {e.get('torch', '-')} | "
            f"{e.get('triton') or '-'} | {e.get('torch_npu') or '-'} | {e.get('cann') or '-'} | {driver} | "
            f"{_switches(e)} | {run.get('source') or '-'} |")


def _loss_gap_section(runs: list[dict], analysis: dict) -> list[str]:
    gapped = [r for r in runs if r.get("loss_gap")]
    if not gapped:
        return []
    lines = ["", "## Mean relative loss gap (Ascend community acceptance)", "",
             f"mean over steps of |loss_run - loss_base| / |loss_base| against {analysis['baseline']}, on the training "
             f"loss the trainer reports (`loss`; `pg/loss` where a directory has no `loss`); accepted below "
             f"{analysis['loss_gap_limit']:.0%} ({ACCEPTANCE_SOURCE}). Only steps both runs logged with a finite loss "
             "count; steps with a near-zero baseline loss are left out and counted; a non-finite loss in the run "
             "fails the rule. Reported beside the verdicts: it does not change them or compare's exit status.", "",
             "| run | loss | mean relative gap | steps compared | near-zero left out | non-finite in run | not reached | result |",
             "|---|---|---|---|---|---|---|---|"]
    for r in gapped:
        g = r["loss_gap"]
        mean = g["mean_relative_gap"]
        shown = "-" if mean is None else ("non-finite" if mean != mean else f"{100 * mean:.3g}%")
        result = {True: "passes", False: "FAILS", None: "not judged"}[g["passes"]]
        lines.append(f"| {r['label']} | {g['metric'] or '-'} | {shown} | {g['steps_compared']} | "
                     f"{len(g['near_zero_steps'])} | {len(g['nonfinite_steps'])} | {len(g['missing_steps'])} | {result} |")
    return lines


def write_report(analysis: dict, out_dir: Path, figure: Path | None, token_figure: Path | None, steps: int) -> Path:
    runs = analysis["runs"]
    lines = ["# portarl stability comparison", ""]
    lines.append(f"{len(runs)} runs x {steps} steps from the same start weights; baseline {analysis['baseline']}; rollouts "
                 + ("replayed from one recording, so only trainer numerics differ (and rewards are the recording's)"
                    if analysis["replay_rollouts"] else "sampled by each run")
                 + f"; a run parts from the baseline where a metric differs by more than "
                 f"{threshold_text(analysis['threshold'])} of its typical size (median magnitude, or spread for "
                 "metrics near 0; never less than the rounding floor: 2 x the coarser dtype's unit roundoff x the "
                 "size of the terms the metric averages)"
                 + (" or its measured noise floor, whichever is larger" if analysis["noise_floor"] else
                    "; no noise floor measured (--noise-floor)")
                 + ". Skipped (non-finite) steps and steps a run never reached count as diverged.")
    if any(r["emulated"] for r in runs):
        lines += ["", "Runs marked [EMULATION] use portarl.backends.emulation: documented numerics of an Ascend stack "
                  "reproduced on this device, not Ascend hardware."]
    lines += ["", "## Verdicts", ""]
    for r in runs:
        lines.append(f"- {r['verdict']}")
        if r.get("loss_gap"):
            lines.append(f"  - {r['loss_gap']['line']}")
    lines += ["", "| run | device | first parting (metric: step) | KL spikes | grad-norm spikes | NaN steps | mean abs d logp | final reward |",
              "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        parted = ", ".join(f"{k}: {v}" for k, v in r["first_divergence"].items() if v is not None) or "-"
        if r["label"] == analysis["baseline"]:
            parted = "(baseline)"
        lines.append(f"| {r['label']}{' [EMULATION]' if r['emulated'] else ''} | {r['device_name']} | {parted} | "
                     f"{len(r['kl_spikes'])} | {len(r['grad_norm_spikes'])} | {len(r['nan_steps'])} | "
                     f"{r['mean_abs_dlogp']:.2e} | {r['final_reward']:.3f} |")
    if analysis["noise_floor"]:
        lines += ["", "Noise floor (largest gap between the baseline and its repeat with another seed): "
                  + ", ".join(f"{k} {v:.3g}" for k, v in analysis["noise_floor"].items())]
    lines += _loss_gap_section(runs, analysis)
    limited = [r for r in runs if r.get("limits")]
    if limited:
        lines += ["", "## Parting limit per metric", "",
                  "limit = max(threshold x max(typical, rounding floor), noise floor, rounding floor); "
                  "'no usable scale': the baseline's typical size is at or below the rounding floor.", "",
                  "| run | metric | typical size | rounding floor | noise floor | limit | scale |",
                  "|---|---|---|---|---|---|---|"]
        for r in limited:
            for key, v in r["limits"].items():
                lines.append(f"| {r['label']} | {key} | {v['typical']:.3g} | {v['rounding_floor']:.3g} | "
                             f"{v['noise_floor']:.3g} | {v['limit']:.3g} | "
                             f"{'usable' if v['usable_scale'] else 'no usable scale'} |")
    if figure is not None:
        lines += ["", f"![stability]({figure.name})"]
    if analysis["tokens"]:
        lines += ["", "## Token-level divergence (identical replayed tokens)", "",
                  f"Per step against {analysis['baseline']}: |d logp| of the trainer's old log-probs on the same "
                  "tokens, the k3 KL between the two, the gap in entropy and in gradient norm. bf16 level: the mean "
                  "|d logp| that rounding the baseline's log-probs to bf16 once causes; a step is above it when "
                  "mean |d logp| exceeds twice that (more than one bf16 rounding apart)."]
        for label, rows in analysis["tokens"].items():
            entry = next(r for r in runs if r["label"] == label)
            lines += ["", f"### {label}: first step above the bf16 level: {entry['tokens']['first_above_bf16']}; "
                      f"far off-policy from step: {entry['off_policy_from']}", "",
                      "| step | max abs d logp | mean abs d logp | bf16 level | k3 KL | mean abs d entropy | abs d grad norm |",
                      "|---|---|---|---|---|---|---|"]
            stride = max(1, len(rows) // 25)
            for t in rows[::stride]:
                lines.append(f"| {t['step']} | {t['max_abs_dlogp']:.3e} | {t['mean_abs_dlogp']:.3e} | {t['bf16_level']:.2e} | "
                             f"{t['k3_kl']:.3e} | {t['entropy_mean_abs_diff']:.3e} | {t['grad_norm_diff']:.3e} |")
        if token_figure is not None:
            lines += ["", f"![token-level divergence]({token_figure.name})"]
    lines += ["", "## Environment per run", "",
              "| run | device | torch | triton | torch_npu | CANN | driver | precision switches | directory |",
              "|---|---|---|---|---|---|---|---|---|"] + [_env_row(r) for r in runs]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
