"""Checkpoint integrity: a manifest of every file (size, sha256), verified before anything is read.

Why: zeroed or random bytes in ``model.safetensors`` load without an error, and a run that
resumes from them fails steps later blaming ``logits``; a truncated or missing file gives a
raw traceback that does not name the file. The manifest is written after every other file
(and fsynced) and before ``COMPLETE``, and ``COMPLETE`` holds the manifest's own sha256, so
a checkpoint is only "complete" when both agree with the bytes on disk. For sharded (DCP)
checkpoints verification runs before torch.distributed.checkpoint reads ``.metadata`` (a
pickle), so a tampered or foreign file is refused before it is unpickled.

Removal is ordered too: ``COMPLETE`` first (and the directory fsynced), then the rest, so a
kill mid-removal never leaves a COMPLETE-marked directory without its files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from portarl.runtime.errors import CheckpointError

MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE"
#: A checkpoint's directory name: ``step-<N>``.
STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 22


def step_of(directory: Path) -> int:
    """The step a checkpoint directory (``step-<N>``) holds."""
    return int(STEP_DIR.match(directory.name).group(1))


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for sub in sorted({p.parent for p in directory.rglob("*")} | {directory}, key=lambda p: -len(p.parts)):
        fsync_dir(sub)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _listed_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() not in (MANIFEST, COMPLETE))


def write_manifest(directory: Path, step: int) -> str:
    """Hash every file of ``directory`` (read back from disk) into ``MANIFEST.json``; returns its sha256."""
    files = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in _listed_files(directory)}
    path = directory / MANIFEST
    path.write_text(json.dumps({"format": 1, "step": step, "files": files}, indent=1, sort_keys=True))
    return sha256_file(path)


def write_complete(directory: Path, step: int, manifest_sha256: str) -> None:
    (directory / COMPLETE).write_text(f"{step}\nmanifest-sha256 {manifest_sha256}\n")


def verify(directory: Path) -> dict:
    """Check ``COMPLETE`` -> ``MANIFEST.json`` -> every listed file; returns the manifest.

    Raises :class:`CheckpointError` naming the checkpoint and the first file that is missing,
    unreadable, of the wrong size or with the wrong sha256, or a file under ``dcp/`` that the
    manifest does not list (a planted shard or ``.metadata``)."""

    def fail(name: str, why: str):
        raise CheckpointError(f"checkpoint {directory}: {name} {why}", directory, name)

    try:
        lines = (directory / COMPLETE).read_text().split("\n")
        expected_manifest = lines[1].split()[1] if len(lines) > 1 and lines[1].startswith("manifest-sha256 ") else None
    except (OSError, UnicodeDecodeError) as err:
        fail(COMPLETE, f"cannot be read ({err})")
    if expected_manifest is None:
        fail(COMPLETE, "names no manifest (written by an older portarl, or damaged): it cannot be verified")
    manifest_path = directory / MANIFEST
    try:
        if sha256_file(manifest_path) != expected_manifest:
            fail(MANIFEST, "does not match the sha256 recorded in COMPLETE (modified or damaged)")
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as err:
        fail(MANIFEST, f"cannot be read ({type(err).__name__}: {err})")
    for name, entry in sorted(files.items()):
        path = directory / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            fail(name, "is not a path inside the checkpoint")
        try:
            size = path.stat().st_size
            if size != entry["size"]:
                fail(name, f"has {size} bytes, the manifest says {entry['size']} (truncated or replaced)")
            if sha256_file(path) != entry["sha256"]:
                fail(name, "does not match its sha256 in the manifest (corrupted or modified)")
        except FileNotFoundError:
            fail(name, "is missing")
        except OSError as err:
            fail(name, f"cannot be read ({err})")
    dcp = directory / "dcp"
    if dcp.is_dir():
        for path in sorted(p for p in dcp.rglob("*") if p.is_file()):
            rel = path.relative_to(directory).as_posix()
            if rel not in files:
                fail(rel, "is not in the manifest (a foreign file): refusing to let DCP read it")
    return manifest


def remove_checkpoint(directory: Path) -> list[str]:
    """Remove ``COMPLETE`` (fsynced) and then the rest; returns what could not be removed."""
    problems: list[str] = []
    marker = directory / COMPLETE
    try:
        marker.unlink(missing_ok=True)
        fsync_dir(directory)
    except OSError as err:
        return [f"{marker}: {err} (left the checkpoint in place)"]

    def onerror(func, path, exc_info):
        problems.append(f"{path}: {exc_info[1]}")

    shutil.rmtree(directory, onerror=onerror)
    if directory.exists() and not problems:
        problems.append(f"{directory}: still exists")
    return problems
