"""Training-stability comparison: the same config trained under several settings.

A setting is ``device:dtype[:variant]`` where the variant is an ops backend
(``reference``, ``cuda``, ``npu``) or a numerics profile (``npu-emulated``: EMULATION of an
Ascend stack's documented numerics, see :mod:`portarl.emulation`). Every run gets the same
data order and seeds. With ``replay=True`` the first run's rollouts are recorded and fed to
the others, so only trainer numerics differ.

Per run: per-step reward, policy loss, KL, grad-norm, entropy, |d logp| rollout vs trainer,
skipped steps; the trainer's own spike events and NaN skips. Against the first run: the
first step where each metric parts by more than ``threshold`` x its typical size. Output:
``report.md`` (a verdict line per run, a table, the figure), ``stability.png`` and
``stability.json``; each run's own logs and checkpoints under ``runs/``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Callable

from portarl.emulation import PROFILES, resolve_profile

METRICS = (
    ("reward/mean", "reward"),
    ("pg/loss", "policy loss"),
    ("kl", "KL"),
    ("grad_norm", "grad norm"),
    ("entropy", "entropy"),
    ("mismatch/abs_diff_mean", "|d logp| rollout vs trainer"),
    ("mismatch/kl_k3", "k3 KL(rollout || trainer)"),
    ("mismatch/masked_frac", "mismatch: fraction masked"),
)
BACKENDS = ("reference", "cuda", "npu")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    device: str
    dtype: str
    variant: str | None = None

    @property
    def label(self) -> str:
        return ":".join(x for x in (self.device, self.dtype, self.variant) if x)

    @property
    def emulated(self) -> bool:
        return self.variant is not None and self.variant in PROFILES and self.variant != "portarl"

    def overrides(self) -> list[str]:
        out = [f"device={self.device}", f"precision.dtype={self.dtype}"]
        if self.variant in BACKENDS:
            out.append(f"precision.backend={self.variant}")
        elif self.variant is not None:
            out.append(f"precision.numerics={self.variant}")
        return out


def parse_runs(text: str) -> list[RunSpec]:
    specs = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"--runs entry {item!r}: use device:dtype[:backend-or-profile], e.g. cpu:bf16:npu-emulated")
        device, dtype = parts[0], parts[1]
        variant = parts[2] if len(parts) == 3 else None
        if dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"--runs entry {item!r}: dtype must be fp32, bf16 or fp16")
        if variant is not None and variant not in BACKENDS:
            try:
                resolve_profile(variant)
            except ValueError:
                raise ValueError(
                    f"--runs entry {item!r}: {variant!r} is neither a backend ({', '.join(BACKENDS)}) "
                    f"nor a numerics profile ({', '.join(PROFILES)})"
                ) from None
        specs.append(RunSpec(device, dtype, variant))
    if not specs:
        raise ValueError("--runs lists no settings")
    if len({s.label for s in specs}) != len(specs):
        raise ValueError("--runs lists a setting twice")
    return specs


@dataclasses.dataclass
class RunResult:
    spec: RunSpec
    rows: list[dict]
    events: list[dict]
    stopped: str | None
    device_name: str

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(r["step"], float(r[key])) for r in self.rows
                if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]

    def spikes(self, kind: str) -> list[int]:
        return [e["step"] for e in self.events if e["kind"] == kind]

    @property
    def nan_steps(self) -> list[int]:
        return [r["step"] for r in self.rows if r.get("skipped")]


def _train_one(spec: RunSpec, base_overrides: list[str], config_path, out_dir: Path, engine_factory):
    from portarl.envinfo import device_name
    from portarl.trainer import GRPOTrainer, TrainConfig, TrainingStopped, build_from_config
    from portarl.trainer.runlog import read_metrics

    run_dir = out_dir / "runs" / spec.label.replace(":", "_")
    overrides = [*base_overrides, *spec.overrides(), f"output_dir={run_dir}",
                 "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]
    config = TrainConfig.load(config_path, overrides)
    model, tokenizer, examples = build_from_config(config)
    trainer = GRPOTrainer(model, tokenizer, None, examples, config, device=config.device)
    engine = engine_factory(trainer)
    if engine is not None:
        trainer.rollout = engine
    stopped = None
    try:
        trainer.train(overwrite=True)  # per-bench scratch runs: a rerun into the same --out replaces them
    except TrainingStopped as err:
        stopped = str(err)
    finally:
        trainer.close()  # a vllm engine holds device memory and process-wide state: one at a time
    result = RunResult(spec, read_metrics(run_dir / "metrics.jsonl"), read_metrics(run_dir / "events.jsonl"),
                       stopped, device_name(trainer.device))
    return result, trainer


def first_divergence(base: RunResult, other: RunResult, key: str, threshold: float) -> int | None:
    """First step where |other - base| > threshold x (median |base| over the run)."""
    a, b = dict(base.series(key)), dict(other.series(key))
    if not a:
        return None
    values = list(a.values())
    # Typical size: the median magnitude, or the spread for metrics that hover around 0
    # (the policy loss of group-normalised advantages).
    spread = statistics.pstdev(values) if len(values) > 1 else 0.0
    scale = max(statistics.median(abs(v) for v in values), spread) or 1e-12
    for step in sorted(set(a) & set(b)):
        if abs(a[step] - b[step]) > threshold * scale:
            return step
    return None


def analyse(results: list[RunResult], threshold: float, replay: bool) -> dict:
    base = results[0]
    runs = []
    for r in results:
        parts = {key: first_divergence(base, r, key, threshold) for key, _ in METRICS if not key.startswith("mismatch/")}
        parted = {k: v for k, v in parts.items() if v is not None}
        first = min(parted.items(), key=lambda kv: kv[1]) if parted and r is not base else None
        kl_spikes, grad_spikes = r.spikes("kl_spike"), r.spikes("grad_norm_spike")
        reward = [v for _, v in r.series("reward/mean")]
        final = statistics.mean(reward[-10:]) if reward else float("nan")
        tag = " [EMULATION]" if r.spec.emulated else ""
        if r is base:
            verdict = f"{r.spec.label}{tag}: baseline"
        elif first is None:
            verdict = f"{r.spec.label}{tag}: tracks {base.spec.label} within {threshold:.0%} on every metric"
        else:
            verdict = f"{r.spec.label}{tag}: parts from {base.spec.label} at step {first[1]} ({first[0]})"
        verdict += (f"; {len(kl_spikes)} KL spike(s), {len(grad_spikes)} grad-norm spike(s), "
                    f"{len(r.nan_steps)} NaN step(s); final reward {final:.3f}")
        if r.stopped:
            verdict += f"; STOPPED: {r.stopped}"
        runs.append({
            "label": r.spec.label, "emulated": r.spec.emulated, "device_name": r.device_name,
            "first_divergence": parts, "kl_spikes": kl_spikes, "grad_norm_spikes": grad_spikes,
            "nan_steps": r.nan_steps, "stopped": r.stopped, "final_reward": final, "verdict": verdict,
            "mean_abs_dlogp": statistics.mean([v for _, v in r.series("mismatch/abs_diff_mean")] or [float("nan")]),
        })
    return {"baseline": base.spec.label, "threshold": threshold, "replay_rollouts": replay, "runs": runs}


def plot(results: list[RunResult], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(2, 4, figsize=(19, 7))
    for ax, (key, title) in zip(axes.flat, METRICS):
        for r in results:
            pts = r.series(key)
            label = r.spec.label + (" (emulated)" if r.spec.emulated else "")
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


def write_report(analysis: dict, results: list[RunResult], out_dir: Path, figure: Path | None, steps: int) -> Path:
    lines = ["# portarl stability comparison", ""]
    lines.append(f"{len(results)} runs x {steps} steps from the same start weights; baseline {analysis['baseline']}; rollouts "
                 + ("replayed from the baseline, so only trainer numerics differ (and rewards are the baseline's)"
                    if analysis["replay_rollouts"] else "sampled by each run")
                 + f"; a run parts from the baseline where a metric differs by more than {analysis['threshold']:.0%} "
                 "of its typical size (median magnitude, or spread for metrics near 0).")
    if any(r["emulated"] for r in analysis["runs"]):
        lines.append("")
        lines.append("Runs marked [EMULATION] use portarl.emulation: documented numerics of an Ascend stack "
                     "reproduced on this device, not Ascend hardware.")
    lines += ["", "## Verdicts", ""] + [f"- {r['verdict']}" for r in analysis["runs"]]
    lines += ["", "| run | device | first parting (metric: step) | KL spikes | grad-norm spikes | NaN steps | mean abs d logp | final reward |",
              "|---|---|---|---|---|---|---|---|"]
    for r in analysis["runs"]:
        parted = ", ".join(f"{k}: {v}" for k, v in r["first_divergence"].items() if v is not None) or "-"
        if r["label"] == analysis["baseline"]:
            parted = "(baseline)"
        lines.append(f"| {r['label']}{' [EMULATION]' if r['emulated'] else ''} | {r['device_name']} | {parted} | "
                     f"{len(r['kl_spikes'])} | {len(r['grad_norm_spikes'])} | {len(r['nan_steps'])} | "
                     f"{r['mean_abs_dlogp']:.2e} | {r['final_reward']:.3f} |")
    if figure is not None:
        lines += ["", f"![stability]({figure.name})"]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _shared_start_model(config_path, overrides: list[str], out_dir: Path, progress) -> Path:
    """Every run starts from the same weights: the config's model after its supervised
    warm-up, done once in fp32 on the CPU (as GPU/NPU comparisons start from one checkpoint)."""
    from portarl.models import save_local
    from portarl.tokenizer import as_codec
    from portarl.trainer import TrainConfig, build_from_config
    from portarl.trainer.sft import run_sft

    config = TrainConfig.load(config_path, [*overrides, "device=cpu"])
    model, tokenizer, examples = build_from_config(config)
    if config.train.sft_warmup_steps:
        if progress:
            progress(f"shared start: {config.train.sft_warmup_steps} supervised warm-up steps (fp32, cpu)")
        run_sft(model, as_codec(tokenizer), examples, steps=config.train.sft_warmup_steps,
                batch_size=config.train.sft_batch_size, lr=config.train.sft_lr, device="cpu", seed=config.train.seed)
    path = out_dir / "runs" / "start-model"
    save_local(model, tokenizer, path)
    return path


def run_stability(
    specs: list[RunSpec],
    *,
    steps: int = 100,
    seed: int = 0,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    out_dir: str | Path = "runs/bench/stability",
    replay: bool = False,
    threshold: float = 0.1,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict, Path]:
    from portarl.rollout import RecordingRollout, ReplayRollout

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_overrides = [*(overrides or []), f"train.steps={steps}", f"train.seed={seed}", "guards.max_consecutive_skips=1000000"]
    recorded: list = []

    def engine_factory(index):
        def make(trainer):
            if not replay:
                return None
            if index == 0:
                rec = RecordingRollout(trainer.rollout)
                recorded.append(rec)
                return rec
            return ReplayRollout(recorded[0].batches)

        return make

    start = _shared_start_model(config_path, base_overrides, out_dir, progress)
    base_overrides += [f"model.path={start}", "train.sft_warmup_steps=0"]
    results = []
    for i, spec in enumerate(specs):
        if progress:
            progress(f"[{i + 1}/{len(specs)}] training {spec.label}" + (" (EMULATION)" if spec.emulated else ""))
        result, _ = _train_one(spec, base_overrides, config_path, out_dir, engine_factory(i))
        results.append(result)
        if replay and i == 0:
            recorded[0].save(out_dir / "runs" / "rollouts.pt")
    analysis = analyse(results, threshold, replay)
    figure = plot(results, out_dir / "stability.png")
    (out_dir / "stability.json").write_text(json.dumps(analysis, indent=1, default=str) + "\n")
    report = write_report(analysis, results, out_dir, figure, steps)
    return analysis, report
