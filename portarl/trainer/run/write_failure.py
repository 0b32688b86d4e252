"""A run's own writes that fail (disk full, a file-size limit, no permission): one line
naming the file and the system's reason, exit 4, never a traceback.

Why: ENOSPC, EFBIG and EACCES on a checkpoint or summary write used to end in a 38-line
Python traceback and exit 1, with no word on which checkpoint failed or that the earlier
ones were intact (they always are: a checkpoint is written into ``.tmp-step-*`` and renamed
into place only once complete). Now the failed write is a :class:`WriteFailed` naming the
file; the checkpoint manager removes its partial ``.tmp-step-*`` at once; ``portarl train``
adds the last intact checkpoint and the command that continues the run, and exits
:data:`EXIT_CODE`.

:func:`writing` marks a block that writes ``path``: an ``OSError`` in it, or a library's
error that carries one only as text (safetensors' ``I/O error: File too large (os error
27)``), becomes :class:`WriteFailed`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

from portarl.runtime.continuation import resume_command

#: ``portarl train``'s exit status when the run could not write a file it needs.
EXIT_CODE = 4

_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)")


class WriteFailed(RuntimeError):
    """Writing ``path`` failed with ``errno``; the message names both (one line)."""

    def __init__(self, path, err: OSError):
        self.path, self.errno = Path(path), err.errno
        name = errno.errorcode.get(err.errno, "") if err.errno is not None else ""
        reason = err.strerror or str(err)
        super().__init__(f"cannot write {self.path}: {reason}" + (f" ({name})" if name else ""))


def os_error_of(err: BaseException) -> OSError | None:
    """The operating system's error behind ``err``: itself, its cause, or the
    ``(os error N)`` that Rust libraries (safetensors) put in their messages."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno is not None:
            return err
        match = _OS_ERROR_TEXT.search(str(err))
        if match:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


#: TEST ONLY (the chaos run, :mod:`portarl.bench.chaos`): a directory where a file
#: ``disk_full.checkpoint`` or ``disk_full.weights`` makes the next write of that kind fail with
#: ENOSPC once its bytes are down (the file is consumed), as a disk that fills mid-write.
CHAOS_DIR_ENV = "PORTARL_CHAOS_DIR"


def _chaos_disk_full(path) -> None:
    chaos = os.environ.get(CHAOS_DIR_ENV)
    if not chaos:
        return
    text = str(path)
    kind = "checkpoint" if ".tmp-step-" in text else "weights" if "weights" in Path(text).name else None
    if kind is None:
        return
    try:
        os.unlink(os.path.join(chaos, f"disk_full.{kind}"))  # once: whoever unlinks it fails
    except FileNotFoundError:
        return
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), text)


@contextlib.contextmanager
def writing(path):
    """A block that writes ``path`` (a file, or a directory of files): its OS errors become
    :class:`WriteFailed` naming the file (the error's own file name when it has one)."""
    try:
        yield
        _chaos_disk_full(path)
    except WriteFailed:
        raise
    except Exception as err:
        cause = os_error_of(err)
        if cause is None:
            raise
        raise WriteFailed(cause.filename or path, cause) from err


#: What a failed write of the run's own files looks like when it reaches the command
#: unmarked (a library's own file, e.g. TensorBoard's event file).
WRITE_ERRNOS = frozenset(getattr(errno, name) for name in ("ENOSPC", "EFBIG", "EDQUOT", "EACCES", "EPERM", "EROFS")
                         if hasattr(errno, name))


def as_write_failure(err: OSError, output_dir) -> WriteFailed | None:
    """An unmarked ``OSError`` of the :data:`WRITE_ERRNOS` kinds as a :class:`WriteFailed`
    (its file, or the output directory), else None (not a failed write: re-raised)."""
    if err.errno not in WRITE_ERRNOS:
        return None
    return WriteFailed(err.filename or output_dir, err)


def intact_checkpoint(trainer) -> str:
    """What is safe on disk, for the message: the newest complete checkpoint."""
    latest = trainer.checkpoints.latest()
    if latest is None:
        return "there is no checkpoint yet"
    from portarl.trainer.checkpoint.manifest import step_of

    return f"the last intact checkpoint is {latest} (step {step_of(latest)})"


__all__ = ["CHAOS_DIR_ENV", "EXIT_CODE", "WRITE_ERRNOS", "WriteFailed", "as_write_failure", "intact_checkpoint", "os_error_of",
           "resume_command", "writing"]
