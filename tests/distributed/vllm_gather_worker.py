"""Worker of tests/distributed/test_vllm_gather.py: the weights each rank's colocated vllm
engine receives (:mod:`portarl.rollout.vllm_weights`) for a tiny Qwen2 with a LoRA adapter
(B randomised, so the adapter changes the merged weights), tied and untied.

Run plainly: one process, the unsharded peft model (:func:`local_weights`). Under torchrun
(Gloo): the peft model's base FSDP2-sharded as the trainer places it, and every rank
consumes :func:`gathered_weights` (small buckets, so several) and writes what it received
to ``<out>/<tied|untied>-rank<r>.safetensors``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from fsdp_linear_worker import tiny
from portarl.assets.lora import apply_lora, base_model
from portarl.rollout.vllm_weights import gathered_weights, local_weights
from portarl.trainer.config.lora import lora_section


def lora_model(tied: bool):
    model = apply_lora(tiny(tied), lora_section({"r": 4, "target_modules": ["q_proj", "v_proj", "up_proj"]}), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def received(tied: bool, sharded: bool) -> dict:
    """What this rank's engine would be handed for the LoRA model (contiguous, for saving)."""
    model = lora_model(tied)
    if not sharded:
        return {k: v.contiguous() for k, v in local_weights(model)}
    from portarl.runtime.distributed import shard

    shard(base_model(model))  # as portarl.trainer.start.setup.place_model does with model.lora
    return {k: v.contiguous() for k, v in gathered_weights(model, dtype=torch.float32, bucket_mb=0.01)}


def main(out: Path) -> None:
    sharded, rank = int(os.environ.get("WORLD_SIZE", "1")) > 1, int(os.environ.get("RANK", "0"))
    if sharded:
        dist.init_process_group("gloo")
    for tied in (True, False):  # each rank writes its own file: no barrier needed
        save_file(received(tied, sharded), str(out / f"{'tied' if tied else 'untied'}-rank{rank}.safetensors"))
    if sharded:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
