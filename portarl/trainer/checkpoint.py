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

    def save_sharded(self, step: int, model, optimizer, tokenizer, state: dict, ctx) -> Path:
        """Every rank writes its shards with torch.distributed.checkpoint (DCP: loadable on any
        number of ranks, or on one process); rank 0 writes the trainer state and ``COMPLETE``
        and renames the directory into place."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from portarl import distributed as pdist

        final = self.root / f"step-{step:06d}"
        tmp = self.root / f".tmp-step-{step:06d}"
        if ctx.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        pdist.barrier(ctx)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        pdist.barrier(ctx)
        if ctx.is_main:
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            torch.save(state, tmp / "trainer_state.pt")
            (tmp / "COMPLETE").write_text(f"{step}\n")
            _fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            for old in self.complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        pdist.barrier(ctx)
        return final

    @staticmethod
    def is_sharded(directory: Path) -> bool:
        return (directory / "dcp").is_dir()

    @staticmethod
    def load_sharded(directory: Path, model, optimizer) -> None:
        """Load a DCP checkpoint into ``model`` / ``optimizer``, sharded or not (resharding to
        this run's number of ranks)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(directory / "dcp"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

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
