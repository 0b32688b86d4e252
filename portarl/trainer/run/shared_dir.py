"""Every rank of a torchrun job must see one output directory: checked at start.

Why: on several nodes, ``--output-dir`` is the same path on every node, but unless it is
on a shared filesystem (NFS, Lustre, a cluster's shared volume) it is a different directory
on each. Then each rank's DCP shards of a checkpoint land on its own node's disk, rank 0
marks the checkpoint complete over a directory that holds only its own shards, and the
loss shows only at ``--resume`` (DCP cannot find the other ranks' shards) or never (the
run ends "fine" and its checkpoints cannot be loaded anywhere).

How: rank 0 writes a file with a fresh random name and content into its output directory
and broadcasts the name; every rank looks for that file in its own output directory
(retrying for :data:`LOOK_S`, for a network filesystem's caches), the answers are gathered,
and rank 0 removes the file. A rank that does not see it makes every rank stop with the
same line, naming ``output_dir`` (``--output-dir``), the ranks and the fix. On one node
the ranks share the local disk, and the check passes at the cost of one small file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from pathlib import Path

import torch

from portarl.runtime import distributed as pdist
from portarl.trainer.run.output_dir import RunDirError
from portarl.trainer.run.write_failure import writing

#: The probe file's name prefix (a random suffix each run).
PROBE = ".portarl-shared-"
#: How long a rank keeps looking for rank 0's file before it reports not seeing it, seconds.
LOOK_S = 3.0


def _sees(path: Path, content: str, look_s: float) -> bool:
    deadline = time.monotonic() + look_s
    while True:
        with contextlib.suppress(OSError):
            if path.read_text() == content:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def check_shared_output_dir(output_dir: str | Path, ctx, look_s: float = LOOK_S) -> None:
    """Refuse (:class:`RunDirError`, on every rank alike) when a rank of the job ``ctx``
    does not see the file rank 0 wrote into ``output_dir``; a no-op for one process."""
    if ctx.world_size < 2:
        return
    directory = Path(output_dir)
    mine = [str(directory.resolve()), socket.gethostname()]
    probe, failed = None, None
    if ctx.is_main:
        probe = directory / f"{PROBE}{secrets.token_hex(8)}"
        try:
            with writing(probe), open(probe, "w") as f:
                f.write(probe.name)
                f.flush()
                os.fsync(f.fileno())
        except Exception as err:  # every rank must hear of it, or they wait for the broadcast
            failed, probe = err, None
    name, main_dir, main_host = pdist.broadcast_json(ctx, [probe.name if probe else None, *mine] if ctx.is_main else None)
    if name is None:
        raise failed if failed is not None else RunDirError(
            f"output_dir (--output-dir): rank 0 could not write into {main_dir} on host {main_host}; see its line")
    try:
        seen = _sees(directory / name, name, look_s)
        flags = pdist.all_gather_cat(ctx, torch.tensor([1 if seen else 0], dtype=torch.int64))
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):
                probe.unlink()
    blind = [rank for rank, flag in enumerate(flags.tolist()) if not flag]
    if blind:
        here = "" if ctx.is_main else f" (rank {ctx.rank} looked in {mine[0]} on host {mine[1]})"
        raise RunDirError(
            f"output_dir (--output-dir) is not shared by every rank: rank 0 wrote a file into {main_dir} on host "
            f"{main_host} and rank{'s' if len(blind) > 1 else ''} {', '.join(map(str, blind))} cannot see it in "
            f"{'their' if len(blind) > 1 else 'its'} output directory{here}; a job on several nodes needs an "
            "output directory on a filesystem every node mounts at the same path (NFS, Lustre, a shared volume): "
            "pass that path as --output-dir on every node")
