"""Atomic checkpoints: nothing a crash (or SIGKILL) interrupts is ever taken for a checkpoint.

Layout: ``<output_dir>/checkpoints/step-000012/`` holding the model (safetensors, via
``save_pretrained``), the tokenizer, ``trainer_state.pt`` (optimizer, scheduler, scaler,
RNG states, step, guard histories) and ``COMPLETE``. A checkpoint is written into a
temporary directory, every file fsynced, ``COMPLETE`` written last, then the directory is
renamed into place and its parent fsynced. Only directories with ``COMPLETE`` are ever
loaded; leftovers of an interrupted write are removed on the next start.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, output_dir: str | Path, keep_last: int = 2):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last

    def clean_partial(self) -> list[Path]:
        """Remove temporary directories left by an interrupted write."""
        removed = []
        if self.root.exists():
            for path in self.root.iterdir():
                if path.name.startswith(".tmp-") or (_STEP_DIR.match(path.name) and not (path / "COMPLETE").exists()):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
        return removed

    def complete(self) -> list[Path]:
        if not self.root.exists():
            return []
        dirs = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and (p / "COMPLETE").exists()]
        return sorted(dirs, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, model, tokenizer, state: dict) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{step:06d}"
        tmp = self.root / f".tmp-step-{step:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / "COMPLETE").write_text(f"{step}\n")
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (resume after a crash right after a save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        for old in self.complete()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def load_state(directory: Path) -> dict:
        return torch.load(directory / "trainer_state.pt", map_location="cpu", weights_only=False)

    @staticmethod
    def load_weights(model, directory: Path) -> None:
        from safetensors.torch import load_model

        missing, unexpected = load_model(model, str(directory / "model.safetensors"), strict=False)
        # save_pretrained drops tied weights (lm_head tied to the embeddings): those may be
        # missing; anything else means the checkpoint does not match the model.
        state = model.state_dict()
        loaded_ptrs = {state[k].data_ptr() for k in state if k not in missing}
        real_missing = [k for k in missing if state[k].data_ptr() not in loaded_ptrs]
        if real_missing or unexpected:
            raise RuntimeError(
                f"checkpoint {directory} does not match the model: missing {real_missing[:5]}, unexpected {unexpected[:5]}"
            )
