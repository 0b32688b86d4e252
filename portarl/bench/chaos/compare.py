"""A chaos run against its uninterrupted twin: the per-step metrics (replayed steps
de-duplicated, the last row of a step kept) and the final checkpoint's tensors, bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: The per-step numbers that must match: the samples' reward, the update, the KL.
COMPARED = ("reward/mean", "reward/std", "loss", "grad_norm", "kl", "completion/len_mean")


def step_rows(run: Path) -> dict[int, dict]:
    """``metrics.jsonl`` by step, the last row of a replayed step kept (GRPO rows only)."""
    rows: dict[int, dict] = {}
    path = Path(run) / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if "step" in row and row.get("phase", "grpo") == "grpo":
                    rows[int(row["step"])] = row
    return rows


def compare_metrics(run: Path, reference: Path, steps: int, upto: int | None = None) -> list[str]:
    """Differences, one line each (none: every step 1..steps present, and equal up to step
    ``upto``, by default all of them)."""
    got, want = step_rows(run), step_rows(reference)
    problems = []
    if sorted(got) != list(range(1, steps + 1)):
        missing = sorted(set(range(1, steps + 1)) - set(got))
        problems.append(f"metrics.jsonl steps: missing {missing[:10]}{'...' if len(missing) > 10 else ''}")
    for step in sorted(set(got) & set(want)):
        if upto is not None and step > upto:
            break
        for key in COMPARED:
            if key in want[step] and got[step].get(key) != want[step][key]:
                problems.append(f"step {step} {key}: {got[step].get(key)!r} vs uninterrupted {want[step][key]!r}")
    return problems


def check_continuation(run: Path, steps: int, after: int, max_staleness: int) -> list[str]:
    """What a valid continuation guarantees from step ``after + 1`` on, where a run may differ
    from its uninterrupted twin by design (async mode after the rollout worker failed: the
    next batch is generated from the checkpoint's weights): every step logged once (checked
    with the metrics), finite numbers, a staleness within ``rollout.max_staleness``, and an
    update that moved (some step with a finite ``grad_norm > 0``)."""
    import math

    rows = step_rows(run)
    problems, moved = [], False
    for step in range(after + 1, steps + 1):
        row = rows.get(step)
        if row is None:
            continue  # named by compare_metrics
        for key in ("loss", "grad_norm", "kl", "reward/mean"):
            if key in row and not math.isfinite(row[key]):
                problems.append(f"step {step} {key} is {row[key]}")
        if row.get("rollout/staleness_max", 0) > max_staleness:
            problems.append(f"step {step}: staleness {row['rollout/staleness_max']} > max_staleness {max_staleness}")
        moved |= math.isfinite(row.get("grad_norm", math.nan)) and row.get("grad_norm", 0) > 0
    if after < steps and not moved:
        problems.append(f"no step after {after} updated the weights (grad_norm 0 throughout)")
    return problems


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: its safetensors files, and for a sharded (DCP) one the
    model and optimizer loaded into the run's model built from its config.yaml."""
    from safetensors.torch import load_file

    from portarl.trainer.checkpoint import CheckpointManager

    out = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    if CheckpointManager.is_sharded(checkpoint):
        from portarl.trainer.config import TrainConfig
        from portarl.trainer.start.build import build_policy

        config = TrainConfig.load(str(checkpoint.parent.parent / "config.yaml"), [])
        model, _ = build_policy(config)
        model = model.float()
        optimizer = torch.optim.AdamW(model.parameters())
        CheckpointManager.load_sharded(checkpoint, model, optimizer)
        out.update({f"model:{k}": v.detach().clone() for k, v in model.state_dict().items()})
    return out


def compare_weights(run: Path, reference: Path, steps: int, *, bitwise: bool = True) -> list[str]:
    """Differences between the two final checkpoints' tensors (none: bitwise equal); with
    ``bitwise`` false, only what a valid continuation guarantees: the last step's checkpoint,
    its tensors named as the twin's and finite."""
    from portarl.trainer.checkpoint import CheckpointManager
    from portarl.trainer.checkpoint.manifest import step_of

    mine, theirs = CheckpointManager(run).latest(), CheckpointManager(reference).latest()
    if mine is None or step_of(mine) != steps:
        return [f"the chaos run's newest checkpoint is {mine}, not step {steps}"]
    a, b = _tensors(mine), _tensors(theirs)
    if not a:
        return [f"no tensors found in {mine}"]
    if sorted(a) != sorted(b):
        return [f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}"]
    if not bitwise:
        return [f"{name} is not finite" for name in sorted(a)
                if a[name].is_floating_point() and not bool(torch.isfinite(a[name]).all())]
    return [f"{name}: max |diff| {float((a[name].double() - b[name].double()).abs().max()):.3g}"
            for name in sorted(a) if not torch.equal(a[name], b[name])]


__all__ = ["COMPARED", "check_continuation", "compare_metrics", "compare_weights", "step_rows"]
