"""The run directory: what one machine leaves for another, and reading it back.

Layout of ``--out DIR``::

    manifest.json          format, steps, seed, runs, which run recorded / replayed rollouts
    config.yaml            the config every run shares (before its own device/dtype/@ overrides)
    start-model/           the shared start weights (safetensors)
    rollouts.safetensors   the recorded rollouts (with --replay-rollouts)
    runs/<run>/            run.json (spec, environment, outcome), metrics.jsonl, events.jsonl,
                           tokens.safetensors (per-step per-token old log-probs and entropy)

Everything is JSON, YAML or safetensors: a directory from another machine is read without
unpickling anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from portarl.bench.stability.runs import RunSpec

FORMAT = "portarl-stability/1"
MANIFEST = "manifest.json"
ROLLOUTS = "rollouts.safetensors"
CONFIG = "config.yaml"
START_MODEL = "start-model"

# Fields a replaying run may set differently from the recording: the setting under test,
# and train.old_logprobs, which every harness run sets to recompute itself (worker.run_job).
PER_RUN = ("device", "output_dir", "precision.", "logging.", "checkpoint.", "guards.", "model.path", "train.steps",
           "train.old_logprobs")
# What a mismatch means, for the refusal message (first matching prefix wins).
CATEGORIES = (
    ("seeds", ("train.seed", "model.init_seed", "rollout.seed_mode")),
    ("data order", ("data.", "train.prompts_per_step")),
    ("prompts", ("rollout.group_size", "rollout.max_new_tokens", "rollout.temperature", "rollout.top_p", "rollout.top_k")),
)


class ReplayMismatch(ValueError):
    """The replaying run is not set up like the recording: replay would compare nothing."""


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a stability run directory (no {MANIFEST}); "
                                "make one with portarl bench stability --out")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


# ---- per-token data ----
def save_tokens(path: Path, steps: dict[int, dict[str, torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    tensors = {f"{step}.{name}": t.detach().to("cpu", torch.float32).contiguous()
               for step, named in steps.items() for name, t in named.items()}
    save_file(tensors, str(path), metadata={"format": "portarl-tokens/1"})


def load_tokens(path: Path) -> dict[int, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    if not path.exists():
        return {}
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(path)).items():
        step, _, name = key.partition(".")
        out.setdefault(int(step), {})[name] = t
    return out


def step_ranges(steps: list[int]) -> str:
    """``1-3, 7`` for steps [1, 2, 3, 7] (sorted), as the reports name runs of steps."""
    out, start = [], None
    for i, s in enumerate(steps):
        start = s if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(str(start) if start == s else f"{start}-{s}")
            start = None
    return ", ".join(out)


# ---- one run, read back ----
@dataclasses.dataclass
class RunResult:
    spec: RunSpec
    rows: list[dict]
    events: list[dict]
    stopped: str | None
    device_name: str
    environment: dict = dataclasses.field(default_factory=dict)
    crashed: str | None = None  # the run's process died: signal name or last error line
    rollouts: dict = dataclasses.field(default_factory=dict)  # mode, sha256 of the rollouts it trained on
    tokens: dict = dataclasses.field(default_factory=dict)  # step -> {old_logp, entropy, rollout_logp}
    steps: int = 0  # steps the run was asked for
    source: str = ""  # the directory it was read from
    alias: str = ""  # set by compare when two directories hold runs of the same setting

    @property
    def label(self) -> str:
        return self.alias or self.spec.label

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(r["step"], float(r[key])) for r in self.rows
                if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]

    def value(self, step: int, key: str) -> float | None:
        for r in self.rows:
            if r["step"] == step:
                v = r.get(key)
                return float(v) if isinstance(v, (int, float)) else None
        return None

    def spikes(self, kind: str) -> list[int]:
        return [e["step"] for e in self.events if e["kind"] == kind]

    @property
    def nan_steps(self) -> list[int]:
        return [r["step"] for r in self.rows if r.get("skipped")]


def load_run(run_dir: Path, source: str = "") -> RunResult:
    from portarl.trainer.run.logger import read_metrics

    info = json.loads((run_dir / "run.json").read_text())
    metrics = run_dir / "metrics.jsonl"
    events = run_dir / "events.jsonl"
    return RunResult(
        spec=RunSpec.from_label(info["label"]),
        rows=[r for r in (read_metrics(metrics) if metrics.exists() else []) if r.get("phase", "grpo") == "grpo"],
        events=read_metrics(events) if events.exists() else [],
        stopped=info.get("stopped"), device_name=info.get("environment", {}).get("device_name", "?"),
        environment=info.get("environment", {}), crashed=info.get("crashed"), rollouts=info.get("rollouts", {}),
        tokens=load_tokens(run_dir / "tokens.safetensors"), steps=int(info.get("steps", 0)), source=source,
    )


def load_directory(directory: str | Path) -> list[RunResult]:
    """Every run of a stability directory, in the order they were run."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    return [load_run(directory / "runs" / r["slug"], source=str(directory)) for r in manifest["runs"]]


# ---- replay compatibility ----
def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _category(key: str) -> str:
    for name, prefixes in CATEGORIES:
        if any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes):
            return name
    return "config"


def check_replay(recorded: dict, here: dict, allowed: list[str], recorded_steps: int, steps: int, source: str) -> None:
    """Refuse a replay whose config differs from the recording anywhere but the setting
    under test (device, precision, the run's own @ overrides), naming each mismatch."""
    a, b = _flatten(recorded), _flatten(here)
    free = tuple(PER_RUN) + tuple(s.partition("=")[0] for s in allowed)
    problems: dict[str, list[str]] = {}
    for key in sorted(set(a) | set(b)):
        if any(key == f or (f.endswith(".") and key.startswith(f)) for f in free):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            problems.setdefault(_category(key), []).append(f"{key}: recorded {a.get(key, '<absent>')!r}, "
                                                          f"here {b.get(key, '<absent>')!r}")
    if steps > recorded_steps:
        problems.setdefault("steps", []).append(f"{steps} steps asked, {recorded_steps} recorded")
    if problems:
        lines = [f"{cat} mismatch: " + "; ".join(items) for cat, items in problems.items()]
        raise ReplayMismatch(f"refusing to replay the rollouts recorded in {source}: " + " | ".join(lines)
                             + ". Replay with the recording's config (drop these --set overrides, or put a "
                             "per-run change in the run spec as @section.field=value).")
