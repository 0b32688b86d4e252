"""A stability run directory as one file: ``pack_record(directory, "gpu.tar")``, and reading
one back (``compare``, ``--replay-from`` and ``dump --from`` take a ``.tar`` where they take a
directory).

A machine that hands back a few files (no deep trees) returns the whole run as one
``.tar`` (``.tar.gz`` / ``.tgz``: gzip). The archive holds the directory under its own name
(``gpu/manifest.json``, ...); ``runs/*/checkpoints`` are left out, as the CI artifact leaves
them out. An archive from another machine is untrusted: before anything is written, every
member must be a regular file or a directory whose relative path stays inside the
extraction folder (no absolute path, no ``..``, no symbolic or hard link, no device or FIFO);
one that is not is refused with :class:`UnsafeArchive` naming it. Extraction then also uses
tarfile's ``filter="data"`` where Python has it (3.11.4+, 3.12). It goes to a temporary
folder that :func:`open_record` removes on exit.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Iterator

from portarl.bench.stability.record import MANIFEST, read_manifest

SUFFIXES = (".tar", ".tar.gz", ".tgz")


class UnsafeArchive(ValueError):
    """A member of a stability archive could write outside its folder, or is not plain data."""


def is_archive(path: str | Path) -> bool:
    """A file (not a directory) named like a tar archive, or one that is a tar archive."""
    p = Path(path)
    return p.is_file() and (p.name.endswith(SUFFIXES) or tarfile.is_tarfile(p))


def _skipped(rel: PurePosixPath) -> bool:
    return len(rel.parts) >= 3 and rel.parts[0] == "runs" and rel.parts[2] == "checkpoints"


def pack_record(directory: str | Path, tar_path: str | Path) -> Path:
    """Pack the stability output ``directory`` into one ``tar_path`` (gzip when it ends in
    ``.gz`` / ``.tgz``) and return it. Refuses a directory that is not a stability run
    directory and one holding a symbolic link (its target would not travel)."""
    directory, tar_path = Path(directory), Path(tar_path)
    read_manifest(directory)  # FileNotFoundError / ValueError: not a stability directory
    files = []
    for path in sorted(directory.rglob("*")):
        rel = PurePosixPath(path.relative_to(directory).as_posix())
        if _skipped(rel) or path.resolve() == tar_path.resolve():
            continue
        if path.is_symlink():
            raise ValueError(f"{path} is a symbolic link: a packed run directory holds plain files only")
        if not (path.is_file() or path.is_dir()):
            raise ValueError(f"{path} is neither a file nor a directory")
        files.append((path, rel))
    mode = "w:gz" if tar_path.name.endswith((".gz", ".tgz")) else "w"
    tar_path.parent.mkdir(parents=True, exist_ok=True)
    partial = tar_path.with_name(tar_path.name + ".partial")
    top = directory.resolve().name or "record"
    with tarfile.open(partial, mode) as tar:
        tar.add(directory, arcname=top, recursive=False)
        for path, rel in files:
            tar.add(path, arcname=f"{top}/{rel}", recursive=False)
    os.replace(partial, tar_path)
    return tar_path


def check_members(tar: tarfile.TarFile, name: str) -> list[tarfile.TarInfo]:
    """Every member, each checked as plain data inside the extraction folder."""
    members = tar.getmembers()
    for m in members:
        what = f"{name}: member {m.name!r}"
        parts = PurePosixPath(m.name.replace("\\", "/")).parts
        if m.name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", m.name):
            raise UnsafeArchive(f"{what} has an absolute path: refused (nothing was extracted)")
        if ".." in parts:
            raise UnsafeArchive(f"{what} climbs out of the archive with '..': refused (nothing was extracted)")
        if m.issym() or m.islnk():
            raise UnsafeArchive(f"{what} is a {'symbolic' if m.issym() else 'hard'} link to {m.linkname!r}: "
                                "refused (nothing was extracted)")
        if not (m.isfile() or m.isdir()):
            raise UnsafeArchive(f"{what} is a device, FIFO or other special file: refused (nothing was extracted)")
    return members


def safe_extract(tar_path: str | Path, into: str | Path) -> None:
    """Extract after :func:`check_members`; tarfile's ``data`` filter on top where available."""
    try:
        with tarfile.open(tar_path, "r:*") as tar:
            members = check_members(tar, str(tar_path))
            if hasattr(tarfile, "data_filter"):
                tar.extractall(into, members=members, filter="data")
            else:  # pragma: no cover - Python without extraction filters; members checked above
                tar.extractall(into, members=members)
    except getattr(tarfile, "FilterError", ()) as err:  # pragma: no cover - the checks above refuse these first
        raise UnsafeArchive(f"{tar_path}: {err}: refused") from None
    except (tarfile.TarError, EOFError, OSError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise ValueError(f"{tar_path} is not a readable tar archive ({err})") from None


def _record_root(folder: Path, name: str) -> Path:
    """The extracted directory: the folder itself, or its one top-level directory."""
    if (folder / MANIFEST).exists():
        return folder
    tops = [p for p in folder.iterdir()]
    if len(tops) == 1 and tops[0].is_dir() and (tops[0] / MANIFEST).exists():
        return tops[0]
    raise FileNotFoundError(f"{name} holds no stability run directory (no {MANIFEST} at its top or in its one "
                            "top-level folder); pack one with portarl bench stability pack DIR")


@contextlib.contextmanager
def open_record(path: str | Path) -> Iterator[Path]:
    """The stability directory at ``path``: the directory itself, or a ``.tar`` of one
    extracted into a temporary folder that is removed when the block ends."""
    path = Path(path)
    if not is_archive(path):
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="portarl-stability-"))
    try:
        safe_extract(path, tmp)
        yield _record_root(tmp, str(path))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
