"""Worker of tests/distributed/test_moe_fsdp.py: the gradients of a tiny Qwen3-MoE whose
expert 3 gets tokens on rank 0 and none on rank 1 (routing replay forces the experts).

Why: FSDP2 reduce-scatters a unit's gradients only if every rank has them; a parameter
without a gradient on one rank (the VLM's vision tower on a text-only micro-batch) would
leave the ranks' collectives mismatched. An expert is a slice of the 3-D ``gate_up_proj``
[E, 2I, H] / ``down_proj`` [E, H, I] (sharded on dim 0, 4 experts on 2 ranks), so an idle
expert should mean a zero slice of a gradient that exists, not a missing one.

Run plainly: one process, an unsharded model, each row's forward and backward in turn
(the same shapes as on a rank); saves the summed gradients and row 1's alone. Under
torchrun: rank r runs row r through the FSDP2-sharded model
(:func:`portarl.runtime.distributed.shard`), its loss times the world size so that FSDP's
average is the sum (x2 is exact in fp32); rank 0 saves the ``full_tensor`` gradients.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from portarl.moe.models import build_tiny_moe
from portarl.moe.routing import set_replay

ROWS = [[1, 5, 9, 13, 17, 21, 25, 29], [1, 6, 10, 14, 18, 22, 26, 30]]
#: per row: the experts of each token (both layers); row 1 never uses expert 3.
EXPERTS = [[(0, 3), (1, 2), (3, 2), (0, 1), (2, 3), (1, 0), (3, 1), (2, 0)],
           [(0, 1), (1, 2), (2, 0), (0, 1), (2, 1), (1, 0), (0, 2), (2, 1)]]


def loss_of(model, row: int) -> torch.Tensor:
    ids = torch.tensor([ROWS[row]])
    experts = torch.tensor([EXPERTS[row], EXPERTS[row]])  # [layers, tokens, k]
    set_replay(model, experts, torch.ones(len(ROWS[row]), dtype=torch.bool))
    logits = model(input_ids=ids).logits[0, :-1].float()
    return -logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).sum()


def main(out: str) -> None:
    model, _ = build_tiny_moe("tiny-qwen3-moe", seed=0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        loss_of(model, 1).backward()
        row1 = {f"row1.{k}": p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        loss_of(model, 0).backward()
        grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        save_file({**grads, **row1}, os.path.join(out, "grads.safetensors"))
        return
    dist.init_process_group("gloo")
    from portarl.runtime.distributed import shard

    shard(model)
    for name, p in model.named_parameters():  # each rank holds 2 whole experts of every expert weight
        if ".experts." in name:
            assert str(p.placements) == "(Shard(dim=0),)" and p.to_local().shape[0] == 2, (name, p.placements)
    rank = dist.get_rank()
    (loss_of(model, rank) * world).backward()
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters() if p.grad is not None}
    if rank == 0:
        save_file(grads, os.path.join(out, "grads.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
