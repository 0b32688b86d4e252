"""Worker of tests/distributed/test_async_torchrun.py: the weights a rank publishes for the
async rollout worker (:func:`portarl.trainer.asynchronous.weights.write_rollout_weights`), for a
tiny Qwen2 tied and untied, in fp32 and cast to bf16, written to
``<out>/<tied|untied>-<dtype>.safetensors``; with peft installed, the same for the model
with a LoRA adapter (B randomised), ``<out>/lora-<tied|untied>-<dtype>.safetensors``, and
under torchrun each rank's record of the gathers (``lora-<tied|untied>-gathers-rank<r>.json``:
for every tensor published, the parameters gathered since the one before, in order).

Run plainly: one process, the unsharded model. Under torchrun (Gloo): the model FSDP2-
sharded (:func:`portarl.runtime.distributed.shard`); every rank takes part in the gather and rank
0 alone writes. The two runs must write the same bytes' worth of tensors.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_linear_worker import tiny
from portarl.trainer.asynchronous.weights import drain, rollout_tensors, write_rollout_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(out: Path) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    for tied in (True, False):
        model = tiny(tied)
        if world > 1:
            from portarl.runtime.distributed import shard

            shard(model)
        for name, dtype in DTYPES.items():
            wrote = write_rollout_weights(model, dtype, out / f"{'tied' if tied else 'untied'}-{name}.safetensors",
                                          is_main=rank == 0)
            assert wrote == (rank == 0)
    try:
        import peft  # noqa: F401
    except ImportError:
        peft = None
    if peft is not None:
        from portarl.assets.lora import base_model
        from vllm_gather_worker import lora_model

        for tied in (True, False):
            model, tag = lora_model(tied), f"lora-{'tied' if tied else 'untied'}"
            if world > 1:
                from portarl.runtime.distributed import shard

                shard(base_model(model))  # as portarl.trainer.start.setup.place_model does with model.lora
                (out / f"{tag}-gathers-rank{rank}.json").write_text(json.dumps(gathers(model, rank == 0)))
            for name, dtype in DTYPES.items():
                write_rollout_weights(model, dtype, out / f"{tag}-{name}.safetensors", is_main=rank == 0)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def gathers(model, is_main: bool) -> list:
    """``[[name published or None, [parameters gathered since the previous one]], ...]`` on
    this rank while :func:`rollout_tensors` runs (``DTensor.full_tensor`` recorded; a gather
    of anything but a parameter's shard is recorded as ``"?"``)."""
    from torch.distributed.tensor import DTensor

    from portarl.assets.lora import base_model

    shards = {p.to_local().data_ptr(): n for n, p in base_model(model).named_parameters()}
    record, pending, full_tensor = [], [], DTensor.full_tensor

    def recording(self, *args, **kwargs):
        pending.append(shards.get(self.to_local().data_ptr(), "?"))
        return full_tensor(self, *args, **kwargs)

    DTensor.full_tensor = recording
    try:
        items = rollout_tensors(model, torch.float32, is_main)
        if is_main:
            for name, _ in items:
                record.append([name, pending[:]])
                pending.clear()
        else:
            drain(items)
        record.append([None, pending[:]])  # gathers after the last tensor, on rank 0; all of them elsewhere
    finally:
        DTensor.full_tensor = full_tensor
    return record


if __name__ == "__main__":
    main(Path(sys.argv[1]))
