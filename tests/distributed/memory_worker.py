"""Worker of tests/distributed/test_fsdp_memory.py, run under torchrun (2 Gloo ranks): one
GRPO step of the tiny model, FSDP2-sharded, for each memory setting in VARIANTS; rank 0
saves the full gradients of the first optimizer step to ``<out>/<variant>.safetensors``
and the number of FSDP2 all-gathers of each variant's step to ``<out>/all_gathers.json``.

The gradients are captured where the optimizer would step (after every micro-batch's
backward and FSDP's reduce-scatter), so they are the step's real gradients."""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import save_file

import portarl.trainer.phases.update as update
from portarl.runtime import distributed as pdist
from portarl.trainer import GRPOTrainer, TrainConfig, build_from_config
from portarl.trainer.memory.checkpointing import checkpointing_enabled
from portarl.trainer.phases.packing import Layout

BASE = ["train.steps=1", "train.prompts_per_step=4", "train.sft_warmup_steps=0", "rollout.group_size=4",
        "rollout.max_new_tokens=5", "data.synthetic_size=64", "data.max_operand=999", "model.hidden_size=32",
        "model.intermediate_size=64", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
        "optim.grad_clip=null", "loss.kl_coef=0.05", "train.old_logprobs=recompute", "train.micro_batch_size=8"]
VARIANTS = {
    "plain": ["train.gradient_checkpointing=false", "train.max_tokens_per_micro_batch=null",
              "train.padding_free=false"],
    "checkpointing": ["train.gradient_checkpointing=true", "train.max_tokens_per_micro_batch=null",
                      "train.padding_free=false"],
    # 12 tokens: every row alone (prompts of 8-12 characters plus the completion), so the
    # ranks' pack counts follow their own lengths and are equalised by splitting.
    "budget": ["train.gradient_checkpointing=false", "train.max_tokens_per_micro_batch=12",
               "train.padding_free=false"],
    "both": ["train.gradient_checkpointing=true", "train.max_tokens_per_micro_batch=30", "train.padding_free=false"],
    # Padding-free (the default): the layout the model's attention gets ("rows" for sdpa),
    # and the one-row layout ("varlen", through SDPA's mask here) so that sequences share a
    # row; with checkpointing and a real-token budget.
    "padding_free": ["train.gradient_checkpointing=true", "train.max_tokens_per_micro_batch=30"],
    "one_row": ["train.gradient_checkpointing=true", "train.max_tokens_per_micro_batch=40"],
}
#: Variants whose layout is forced (the one-row layout needs flash attention otherwise).
LAYOUT = {"one_row": "varlen"}


def varied_reward(prompt, completion, answer):
    return float(sum(map(ord, completion)) % 5)


def _count_all_gathers(counter: dict) -> None:
    """Count FSDP2's parameter all-gathers (one per FSDP module unshard)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    real = group.foreach_all_gather

    def counted(*args, **kwargs):
        counter["all_gathers"] += 1
        return real(*args, **kwargs)

    group.foreach_all_gather = counted


def gradients(out: str, name: str, counter: dict) -> dict[str, torch.Tensor]:
    cfg = TrainConfig.load(None, [*BASE, *VARIANTS[name], f"output_dir={out}/{name}"])
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, [varied_reward], examples, cfg, device="cpu")
    assert checkpointing_enabled(trainer.model) == cfg.train.gradient_checkpointing
    assert (trainer.padding_free is None) == (cfg.train.padding_free is False), trainer.padding_free
    if name in LAYOUT:
        trainer.padding_free = Layout(LAYOUT[name])
    grads: dict = {}

    def capture(tr):
        for n, p in tr.model.named_parameters():
            if p.grad is not None:
                g = p.grad
                grads[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        return {}

    update.guarded_optimizer_step = capture
    counter["all_gathers"] = 0
    metrics = trainer.train_step()
    counter[name] = counter["all_gathers"]
    assert metrics["skipped"] == 0, metrics
    return grads


def main(out: str) -> None:
    counter: dict = {}
    _count_all_gathers(counter)
    for name in VARIANTS:
        grads = gradients(out, name, counter)
        if pdist.init_distributed(torch.device("cpu"))[0].is_main:
            save_file({k: v.contiguous() for k, v in grads.items()}, f"{out}/{name}.safetensors")
    if pdist.init_distributed(torch.device("cpu"))[0].is_main:
        counter.pop("all_gathers")
        with open(f"{out}/all_gathers.json", "w") as f:
            json.dump(counter, f)
    pdist.barrier(pdist.init_distributed(torch.device("cpu"))[0])
    pdist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
