"""Supervised fine-tuning on (prompt, answer) pairs: the demo's warm-up, and ``portarl sft``.

The loss is the mean negative log-prob of the answer tokens (and EOS), computed with
:func:`portarl.ops.logprobs` like every other log-prob in portarl.
"""

from __future__ import annotations

import logging
import random

import torch

from portarl.runtime import distributed as pdist
from portarl.assets.data import Example, load_examples_for
from portarl.assets.tokenizer import TextCodec
from portarl.trainer.run.progress import progress_bar
from portarl.trainer.phases.sequences import build_batch, completion_logprobs

log = logging.getLogger("portarl.train")


def sft_batch(codec: TextCodec, examples: list[Example], device):
    missing = next((ex for ex in examples if ex.answer is None), None)
    if missing is not None:
        raise ValueError(f"{missing.where or 'an example'}: no answer field; supervised training needs one (set "
                         "data.answer_field, or train.sft_warmup_steps=0)")
    encode_example = getattr(codec, "encode_example", None)  # a vision-language model: prompt and images
    prompts = [encode_example(ex) if encode_example else codec.encode_prompt(ex.prompt) for ex in examples]
    # A chat model's turn ends with its end-of-turn token (<|im_end|>), not eos.
    answers = [codec.encode_continuation(ex.answer) + [codec.completion_end_id] for ex in examples]
    vision = codec.batch_vision(examples, 1) if encode_example else None
    return build_batch(prompts, answers, codec.pad_token_id, device, vision=vision)


def run_sft(model, codec: TextCodec, examples: list[Example], *, steps: int, batch_size: int, lr: float,
            device, seed: int = 0, on_step=None, logits_policy: str = "fp32", precision=None,
            dist=None) -> list[float]:
    """``steps`` AdamW steps on random batches; returns the losses. ``on_step(step, loss)``.

    ``precision`` (a :class:`~portarl.trainer.guards.precision.PrecisionPlan`, the trainer's): step
    its fp32 masters with fp32 AdamW state and its loss scale, as GRPO does, and leave the
    masters holding the warm-up's result. Without it AdamW steps the parameters in their own
    dtype (fine for fp32; fp16 would divide by eps = 0).

    ``dist`` (under torchrun, FSDP2): every rank draws the same batch and takes its equal
    share of the rows; the loss is normalised by the global answer-token count and scaled
    by the world size (FSDP2 averages gradients over ranks), so the update is one process's
    on the whole batch. Overflow and non-finite checks read the global gradient norm, the
    same on every rank."""
    rng = random.Random(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    targets = precision.optimizer_params() if precision is not None else params
    optimizer = torch.optim.AdamW(targets, lr=lr, weight_decay=0.0)
    sharded = dist is not None and dist.enabled
    losses = []
    model.train()
    for step in range(1, steps + 1):
        rows = rng.sample(examples, min(batch_size, len(examples)))
        if sharded:
            if len(rows) % dist.world_size:
                raise ValueError(f"the SFT batch of {len(rows)} examples does not split over {dist.world_size} ranks: "
                                 "make train.sft_batch_size (and the data) a multiple of the ranks")
            share = len(rows) // dist.world_size
            rows = rows[dist.rank * share:(dist.rank + 1) * share]
        batch = sft_batch(codec, rows, device)
        logp = completion_logprobs(model, batch, temperature=1.0, logits_policy=logits_policy)
        if sharded:
            local = -(logp * batch.mask).sum()
            totals = pdist.all_reduce(dist, torch.stack([local.detach(), batch.mask.sum().to(local.dtype)]))
            loss, reported = local / totals[1] * dist.world_size, totals[0] / totals[1]
        else:
            loss = reported = -(logp * batch.mask).sum() / batch.mask.sum()
        if not torch.isfinite(reported):
            raise FloatingPointError(f"SFT loss is {reported.item()} at step {step}")
        if precision is None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            if sharded and not torch.isfinite(pdist.full(norm)):
                raise FloatingPointError(f"SFT gradient is not finite at step {step}")
            optimizer.step()
        else:
            precision.zero_grad()
            precision.scale_loss(loss).backward()
            if sharded:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                overflow = not bool(torch.isfinite(pdist.full(norm)))
            else:
                overflow = not all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
            if overflow and precision.dynamic:
                precision.update_scale(overflow=True)  # fp16: a lower loss scale, this batch skipped
            elif overflow:
                raise FloatingPointError(f"SFT gradient is not finite at step {step}")
            else:
                precision.unscale_grads()
                torch.nn.utils.clip_grad_norm_(targets, 1.0)
                optimizer.step()
                precision.after_step()
                precision.update_scale(overflow=False)
            precision.zero_grad()
        losses.append(float(reported.detach()))
        if on_step is not None:
            on_step(step, float(reported.detach()))
    return losses


def demonstrations(config, examples: list[Example]) -> list[Example]:
    """The rows supervised training reads: ``data.sft_path``'s when it is set (with data.path's
    fields), else ``examples`` (the GRPO prompts)."""
    d = config.data
    if d.sft_path is None:
        return list(examples)
    try:
        return load_examples_for(d, d.sft_path)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"data.sft_path: {err}") from None


def warm_up(trainer, logger=None) -> list[float]:
    """A GRPO run's supervised warm-up of ``trainer.model`` (``train.sft_warmup_steps``): its
    own progress bar (the GRPO bar starts at the first GRPO step), or log lines without one
    (``logger`` None: silent). Returns the losses."""
    cfg = trainer.config.train
    bar = progress_bar(cfg.sft_warmup_steps, "sft warm-up",
                       enabled=logger is not None and trainer.config.logging.progress and trainer.dist.is_main)

    def on_step(step, loss):
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
        elif logger is not None and (step % 10 == 0 or step == cfg.sft_warmup_steps):
            log.info("sft warm-up %d/%d: loss %.4f", step, cfg.sft_warmup_steps, loss)

    try:
        losses = run_sft(trainer.model, trainer.codec, trainer.sft_examples, steps=cfg.sft_warmup_steps,
                         batch_size=cfg.sft_batch_size, lr=cfg.sft_lr, device=trainer.device, seed=cfg.seed,
                         on_step=on_step, logits_policy=trainer.config.precision.logits,
                         precision=trainer.precision, dist=trainer.dist)
    finally:
        if bar is not None:
            bar.close()
    if bar is not None and losses:
        log.info("sft warm-up: %d steps, loss %.4f -> %.4f", len(losses), losses[0], losses[-1])
    return losses
