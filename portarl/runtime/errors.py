"""Errors raised on more than one layer: a bad configuration value (the trainer's config
sections, the multi-turn settings) and a checkpoint that cannot be trusted (the trainer's
checkpoints, LoRA adapters, ``portarl export``). Here, below all of them, so that a module
low in the package can raise the error a user catches at the top. Their homes re-export
them: :class:`portarl.trainer.config.ConfigError`,
:class:`portarl.trainer.checkpoint.CheckpointError`."""

from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field (``section.field``)."""


class CheckpointError(RuntimeError):
    """A checkpoint failed verification or could not be read; the message names it and the file."""

    def __init__(self, message: str, checkpoint: Path | None = None, file: str | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint
        self.file = file
