"""Worker of tests/distributed/test_fsdp_linear_logprobs.py: score a fixed batch of 4
sequences with the trainer's op path (:func:`portarl.trainer.phases.sequences.completion_logprobs`,
hence ``ops.linear_logprobs``) on a tiny Qwen2, tied and untied, and save per-token
log-probs, entropy, d loss / d hidden (the op's input) and d loss / d output-embedding
weight to ``<out>/<tied|untied>.safetensors``.

Run plainly: one process, an unsharded model, the whole batch. Under torchrun (Gloo): each
rank scores its own rows of the batch through an FSDP2-sharded model
(:func:`portarl.runtime.distributed.shard`); rank 0 saves the gathered rows and the ``full_tensor``
of the weight gradient. Each rank's loss is multiplied by the world size so that FSDP's
gradient average equals the single process's sum (x2 is exact in fp32).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from portarl import ops
from portarl.trainer.phases.sequences import _is_sharded, build_batch, completion_logprobs

VOCAB = 53
TEMPERATURE = 0.7
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
COMPLETIONS = [[20, 21, 22, 23], [24, 25], [26, 27, 28], [29, 30, 31, 32]]


def tiny(tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, rms_norm_eps=1e-6, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    # Larger head weights than the init's 0.02 std: logits of O(1), a non-trivial softmax.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10.0)
    return model


def run(tied: bool, rank: int, world: int) -> dict[str, torch.Tensor] | None:
    model = tiny(tied)
    if world > 1:
        from portarl.runtime.distributed import shard

        shard(model)
        assert _is_sharded(model)
    rows = slice(rank * len(PROMPTS) // world, (rank + 1) * len(PROMPTS) // world)
    batch = build_batch(PROMPTS[rows], COMPLETIONS[rows], pad_id=0, device=torch.device("cpu"))

    seen = {}
    real = ops.linear_logprobs

    def spy(hidden, weight, labels, **kwargs):  # the op's own inputs, as the trainer passes them
        hidden.retain_grad()
        seen["hidden"], seen["weight"] = hidden, weight
        seen["weight_values"] = weight.detach().clone()  # FSDP frees the gathered storage after backward
        return real(hidden, weight, labels, **kwargs)

    ops.linear_logprobs = spy
    try:
        logp, entropy = completion_logprobs(model, batch, temperature=TEMPERATURE, with_entropy=True)
    finally:
        ops.linear_logprobs = real
    assert "hidden" in seen, "completion_logprobs did not go through ops.linear_logprobs"
    vocab_rows = seen["weight"].shape[0]
    assert type(seen["weight"]) is torch.Tensor or not hasattr(seen["weight"], "full_tensor"), \
        "the op must receive the gathered (unsharded) head weight, not a DTensor shard"
    assert vocab_rows == VOCAB

    gen = torch.Generator().manual_seed(1)
    g_logp = torch.randn(len(PROMPTS), logp.shape[1], generator=gen)[rows]
    g_ent = torch.randn(len(PROMPTS), logp.shape[1], generator=gen)[rows]
    ((logp * g_logp + entropy * g_ent).sum() * world).backward()

    grad_w = model.get_output_embeddings().weight.grad
    if hasattr(grad_w, "full_tensor"):
        grad_w = grad_w.full_tensor()
    local = {"logp": logp.detach(), "entropy": entropy.detach(), "grad_hidden": seen["hidden"].grad / world,
             "hidden": seen["hidden"].detach(), "weight": seen["weight_values"]}
    if world > 1:
        for key in ("logp", "entropy", "grad_hidden", "hidden"):
            parts = [torch.empty_like(local[key]) for _ in range(world)]
            dist.all_gather(parts, local[key].contiguous())
            local[key] = torch.cat(parts)
    local["grad_weight"] = grad_w.detach()
    return local if rank == 0 else None


def main(out_dir: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    ok = False
    try:
        for tied in (True, False):
            result = run(tied, rank, world)
            if result is not None:
                save_file({k: v.contiguous() for k, v in result.items()},
                          os.path.join(out_dir, f"{'tied' if tied else 'untied'}.safetensors"))
        ok = True
    finally:
        if world > 1:
            if ok:  # tear down together: a rank that destroys its Gloo group while the other is
                dist.barrier()  # still writing once aborted ("terminate called") on a loaded CI machine
            dist.destroy_process_group()


if __name__ == "__main__":
    # portarl's exit path for a torchrun rank (portarl/runtime/exit_path.py): no interpreter
    # finalisation for Gloo's threads to race.
    from portarl.runtime.exit_path import leave_process

    code = 1
    try:
        main(sys.argv[1])
        code = 0
    except Exception:
        import traceback

        traceback.print_exc()
    leave_process(code)
