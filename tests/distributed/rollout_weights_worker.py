"""Worker of tests/distributed/test_async_torchrun.py: the weights a rank publishes for the
async rollout worker (:func:`portarl.trainer.asynchronous.weights.write_rollout_weights`), for a
tiny Qwen2 tied and untied, in fp32 and cast to bf16, written to
``<out>/<tied|untied>-<dtype>.safetensors``.

Run plainly: one process, the unsharded model. Under torchrun (Gloo): the model FSDP2-
sharded (:func:`portarl.distributed.shard`); every rank takes part in the gather and rank
0 alone writes. The two runs must write the same bytes' worth of tensors.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_linear_worker import tiny
from portarl.trainer.asynchronous.weights import write_rollout_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(out: Path) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    for tied in (True, False):
        model = tiny(tied)
        if world > 1:
            from portarl.distributed import shard

            shard(model)
        for name, dtype in DTYPES.items():
            wrote = write_rollout_weights(model, dtype, out / f"{'tied' if tied else 'untied'}-{name}.safetensors",
                                          is_main=rank == 0)
            assert wrote == (rank == 0)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
