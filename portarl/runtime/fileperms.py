"""File modes of what portarl writes: the ordinary ``0666 & ~umask`` for every file.

Why: safetensors writes through a private temporary file (mode 0600) and renames it, so
``model.safetensors`` came out 0600 beside 0644 config and tokenizer files: a checkpoint or
an exported model another user (a serving account, a shared cluster group) could partly read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def current_umask() -> int:
    """The process umask (read by setting and restoring it; there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normalize_modes(directory: str | Path) -> None:
    """Give every regular file under ``directory`` the mode a plain ``open(..., 'w')``
    would have (``0666 & ~umask``), keeping any execute bits it already had."""
    mode = 0o666 & ~current_umask()
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            old = stat.S_IMODE(path.stat().st_mode)
            new = mode | (old & 0o111)
            if old != new:
                os.chmod(path, new)
