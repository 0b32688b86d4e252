"""The command that continues a run after it ended early: ``--resume`` when there is a
checkpoint, else one that starts it again and is not refused.

Why: a write failure before the first checkpoint printed "continue with: ... --resume",
and that command was refused ("no checkpoint to continue from"). A directory that holds
another run's metrics (steps logged, none checkpointed) refuses a fresh start too, unless
``--overwrite`` (:func:`portarl.trainer.run.output_dir.check_output_dir`), so the command
here adds it exactly then.

Standard library only: the supervising parent (:mod:`portarl.runtime.supervisor`) builds the command
without importing torch.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

_STEP_DIR = re.compile(r"step-\d{6,}")

#: The flags that say how a run starts: the command chosen here replaces them.
START_FLAGS = ("--overwrite", "--resume-or-start", "--resume")


def existing_run(directory: Path) -> str | None:
    """A short description of the run in ``directory``, or None when it holds none."""
    found = []
    ckpts = directory / "checkpoints"
    if ckpts.is_dir():
        steps = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-"))
        if steps:
            found.append(f"{len(steps)} checkpoint(s), the last {steps[-1]}")
    metrics = directory / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        lines = sum(1 for line in metrics.read_text().splitlines() if line.strip())
        found.append(f"metrics.jsonl with {lines} step(s)")
    return ", ".join(found) or None


def newest_checkpoint(output_dir) -> Path | None:
    """The newest complete checkpoint of the run in ``output_dir`` (a ``step-*`` directory
    with its ``COMPLETE`` marker, :mod:`portarl.trainer.checkpoint.manifest`), or None."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and (p / "COMPLETE").is_file())
    return done[-1] if done else None


def resume_command(argv: list[str]) -> str:
    """``portarl train ...`` as it was run, continuing the run: ``--resume`` instead of
    ``--overwrite`` or ``--resume-or-start``."""
    kept = [a for a in argv if a not in START_FLAGS]
    return shlex.join(["portarl", *kept, "--resume"])


def continue_command(argv: list[str], output_dir, checkpoint) -> str:
    """The ``portarl train`` command that continues the run in ``output_dir`` from
    ``checkpoint`` (the newest one; None: there is none): ``--resume``; with none, the
    command again without ``--resume``, with ``--overwrite`` when the directory holds what
    a fresh start would refuse (steps logged), as it was typed otherwise."""
    if checkpoint is not None:
        return resume_command(argv)
    kept = [a for a in argv if a not in START_FLAGS]
    if output_dir is not None and existing_run(Path(output_dir)):
        kept.append("--overwrite")
    return shlex.join(["portarl", *kept])


def rerun_command(argv: list[str]) -> str:
    """The command as it was typed (``sft``, ``eval``: they save nothing until the end)."""
    return shlex.join(["portarl", *argv])


__all__ = ["continue_command", "existing_run", "newest_checkpoint", "rerun_command", "resume_command"]
