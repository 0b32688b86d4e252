"""``portarl export --checkpoint C --out DIR``: a training checkpoint as a plain Hugging Face
model directory (``from_pretrained``-loadable, vLLM-servable).

Why a command: a LoRA checkpoint holds only the adapter (the base weights are rebuilt from
``model.path``), and every checkpoint carries trainer state a serving stack does not want.
Export rebuilds the model from the run config saved in the checkpoint's trainer state,
loads the checkpoint's weights (a LoRA adapter: applied and merged, ``W + scaling * B @ A``,
see :func:`portarl.assets.lora.merged_state_dict`), and writes the weights (safetensors), the
model config and the tokenizer.

The checkpoint is verified against its manifest first (like ``--resume``), and the output is
written to a temporary directory beside ``DIR`` and renamed into place, so an interrupted
export leaves no half-written ``DIR``.
"""

from __future__ import annotations

import shutil
from pathlib import Path


class ExportError(ValueError):
    """The export cannot be done as asked; the message names the argument and the fix."""


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory (``.../checkpoints/step-000012``), or a run's output directory
    (its newest complete checkpoint). Refuses a missing or incomplete one."""
    from portarl.trainer.checkpoint import CheckpointManager
    from portarl.trainer.checkpoint import manifest as mf

    path = Path(path)
    if not path.exists():
        raise ExportError(f"--checkpoint {path} does not exist")
    if not path.is_dir():
        raise ExportError(f"--checkpoint {path} is a file; pass a checkpoint directory (e.g. "
                          "runs/train/checkpoints/step-000300) or a run's output directory")
    run_root = path.parent if path.name == "checkpoints" else path
    if not (path / mf.MANIFEST).exists() and (run_root / "checkpoints").is_dir():  # a run directory
        latest = CheckpointManager(run_root).latest()
        if latest is None:
            raise ExportError(f"--checkpoint {path}: the run holds no complete checkpoint")
        path = latest
    if not (path / mf.COMPLETE).exists():
        raise ExportError(f"--checkpoint {path} is incomplete (no {mf.COMPLETE} marker: its write was interrupted, "
                          "or it is not a portarl checkpoint); export an earlier checkpoint")
    return path


def prepare_out(out: str | Path, overwrite: bool, checkpoint: Path) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; choose a directory")
    if out.resolve() in (checkpoint.resolve(), *checkpoint.resolve().parents):
        raise ExportError(f"--out {out} holds the checkpoint being exported; choose another directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {out} exists and is not empty: pass --overwrite to replace it, or choose another "
                          "directory")
    return out


def load_checkpoint_model(checkpoint: str | Path):
    """``(directory, config, model, tokenizer)`` of a checkpoint (or a run directory's newest):
    the model rebuilt from the run config saved in it, its weights loaded (a LoRA adapter
    applied, not merged), in the run's dtype, on the CPU. Verifies the manifest first.
    Raises :class:`ExportError` naming ``--checkpoint`` when it cannot be used."""
    from portarl.assets.lora import apply_lora, load_adapter, require_peft
    from portarl.assets.models import build_model
    from portarl.trainer.checkpoint import CheckpointManager
    from portarl.trainer.checkpoint.safe_state import UnsafeStateError
    from portarl.trainer.config import ConfigError, TrainConfig
    from portarl.trainer.guards.precision import DTYPES

    directory = resolve_checkpoint(checkpoint)
    try:
        state = CheckpointManager.load_state(directory)  # verifies the manifest first
    except UnsafeStateError as err:
        raise ExportError(str(err)) from None
    try:
        config = TrainConfig.from_dict(state["config"])
    except (ConfigError, KeyError, TypeError) as err:
        raise ExportError(f"--checkpoint {directory}: its saved run config is not usable ({err})") from None
    config.source_dir = state.get("source_dir")  # where the run's config file was (code search)
    if CheckpointManager.is_sharded(directory):
        raise ExportError(f"--checkpoint {directory} is a sharded (FSDP2 / DCP) checkpoint, which this command does "
                          "not read yet; use one written by a single-process run")
    dtype = DTYPES[config.precision.dtype]
    model, tokenizer = build_model(config.model, dtype)
    if config.model.lora is not None:
        require_peft()
        model = apply_lora(model, config.model.lora, seed=config.model.init_seed)
        model.to(dtype=dtype)  # as trained: the adapter tensors were saved in this dtype
        load_adapter(model, directory)
    else:
        model.to(dtype=dtype)
        CheckpointManager.load_weights(model, directory, verify=False)  # verified just above
    return directory, config, model, tokenizer


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write the model of ``checkpoint`` (LoRA merged in) to ``out`` as a Hugging Face
    directory; returns ``out``. Raises :class:`ExportError` (usage) or
    :class:`~portarl.trainer.checkpoint.CheckpointError` (a damaged checkpoint)."""
    from portarl.assets.lora import save_merged

    directory = resolve_checkpoint(checkpoint)
    out = prepare_out(out, overwrite, directory)
    _, _, model, tokenizer = load_checkpoint_model(directory)
    tmp = out.parent / f".{out.name}.tmp-export"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_merged(model, tmp, tokenizer)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
