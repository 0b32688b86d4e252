"""The value model of PPO (``loss.advantage_estimator: gae``): built beside the policy,
scored in the scoring phase (the old values), trained in the update phase after the policy
(the clipped value loss, :mod:`portarl.core.gae`), kept in checkpoints.

The critic is a copy of the policy's causal LM whose output head is a scalar value head
(``critic.init: policy``, the head at 0 so every first value is 0), or a reward model's
backbone and score head (``critic.init: DIR``). Being a causal LM, its values come through
the policy's own code path, :func:`portarl.trainer.phases.sequences.completion_hidden`:
the hidden state at the position before each completion token (the state the token was
sampled from: verl's ``values = logits[:, -T - 1 : -1]``) in the padded, padding-free
and shared-prompt layouts alike, and under FSDP2. It is trained in fp32 (its own AdamW,
``critic.lr``), with ``model.lora`` through a LoRA adapter of its own and a trainable head.

``critic.warmup_steps``: the first steps train the critic alone; the policy's weights and
optimizer do not move (its update is not run at all).
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F

from portarl.runtime import distributed as pdist

log = logging.getLogger("portarl.train")


def _value_head(model, hidden: int) -> torch.nn.Linear:
    head = torch.nn.Linear(hidden, 1, bias=True)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    model.set_output_embeddings(head)
    model.config.tie_word_embeddings = False  # the head is the critic's own, never the input embedding
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None
    return head


def _from_reward_model(path: str, like):
    """A causal LM of the reward model's architecture holding its backbone, with its score head."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32, num_labels=1)
    lm = AutoModelForCausalLM.from_config(rm.config)
    backbone = getattr(rm, rm.base_model_prefix)
    getattr(lm, lm.base_model_prefix).load_state_dict(backbone.state_dict())
    head = rm.score
    lm.set_output_embeddings(head)
    lm.config.tie_word_embeddings = False
    return lm


class Critic:
    """The value model, its optimizer, and its state for checkpoints."""

    def __init__(self, trainer, unplaced_policy):
        cfg = trainer.config
        c = cfg.critic
        if c.init == "policy":
            model = copy.deepcopy(unplaced_policy).float()
            _value_head(model, model.get_output_embeddings().weight.shape[1])
        else:
            model = _from_reward_model(c.init, unplaced_policy)
        if cfg.model.lora is not None:
            from portarl.assets.lora import apply_lora

            model = apply_lora(model, cfg.model.lora, seed=cfg.model.init_seed + 1)
            for p in model.get_output_embeddings().parameters():  # the value head learns in full
                p.requires_grad_(True)
        model = model.to(trainer.device, dtype=torch.float32)
        if trainer.dist.enabled:
            model = pdist.shard(model)
        model.train()
        self.model, self.trainer, self.config = model, trainer, c
        params = [p for p in model.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(params, lr=c.lr if c.lr is not None else o.lr, betas=(o.beta1, o.beta2),
                                           eps=o.eps, weight_decay=c.weight_decay)

    # ------------------------------------------------------------------ values
    def values(self, batch) -> torch.Tensor:
        """fp32 [B, T]: V at each completion token (0 off the mask), with the gradient when enabled."""
        from portarl.trainer.phases.packing import to_grid
        from portarl.trainer.phases.sequences import completion_hidden

        hidden, weight, bias = completion_hidden(self.model, batch)
        v = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float()).squeeze(-1)
        return to_grid(batch, v) * batch.mask

    @torch.no_grad()
    def scored_values(self, batch) -> torch.Tensor:
        """The old values (the rollout's), micro-batched as the no-grad scoring forwards."""
        from portarl.trainer.phases.micro_batches import micro_batches

        out = torch.zeros(batch.labels.shape, dtype=torch.float32, device=batch.labels.device)
        for rows, part in micro_batches(self.trainer, batch):
            out[rows, : part.labels.shape[1]] = self.values(part)  # a micro-batch may keep fewer columns
        return out

    def sync_from(self, policy) -> None:
        """After the supervised warm-up: the backbone starts from the warmed-up policy
        (``critic.init: policy``; one process: the same parameter names)."""
        if self.config.init != "policy" or self.trainer.dist.enabled:
            return
        mine = dict(self.model.named_parameters())
        head = {id(p) for p in self.model.get_output_embeddings().parameters()}
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if name in mine and id(mine[name]) not in head and mine[name].shape == p.shape:
                    mine[name].copy_(p.float())

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        """Weights and optimizer state (every rank under torchrun: a collective gather)."""
        if self.trainer.dist.enabled:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict)

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return {"model": get_model_state_dict(self.model, options=options),
                    "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options)}
        return {"model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict()}

    def load(self, state: dict) -> None:
        if self.trainer.dist.enabled:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)

            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
            set_model_state_dict(self.model, state["model"], options=options)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
            return
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def critic_update(trainer, scored, metrics: dict) -> None:
    """The value model's optimizer steps of the iteration (the policy's schedule: ppo_epochs x
    mini_batches, each micro-batched), on the returns and old values of ``scored``."""
    from portarl.core.gae import explained_variance, value_loss
    from portarl.trainer.phases.micro_batches import micro_batches, rows_of
    from portarl.trainer.phases.update import mini_batch_rows

    critic, cfg, dist = trainer.critic, trainer.config, trainer.dist
    batch = scored.batch
    n = batch.labels.shape[0]
    totals: dict[str, float] = {}
    count = 0
    for epoch in range(cfg.train.ppo_epochs):
        for rows in mini_batch_rows(n, cfg.train.mini_batches, cfg.train.seed, trainer.hook_step, epoch):
            part_batch = batch.rows(rows)
            returns, old = scored.returns[rows], scored.values[rows]
            mask = part_batch.mask.bool()
            counts = pdist.all_reduce(dist, torch.stack([mask.sum(), mask.any(dim=-1).sum()]).float()).tolist()
            norms = dict(num_global_tokens=int(counts[0]), num_global_seqs=int(counts[1]))
            critic.optimizer.zero_grad(set_to_none=True)
            for sub, part in micro_batches(trainer, part_batch):
                vpreds = critic.values(part)
                loss, m = value_loss(vpreds, rows_of(returns, sub, part), rows_of(old, sub, part), part.mask,
                                     cliprange=critic.config.cliprange_value, mode=cfg.loss.loss_agg_mode, **norms)
                (loss * dist.world_size if dist.enabled else loss).backward()
                share = part.labels.shape[0] / part_batch.labels.shape[0]
                totals["value/loss"] = totals.get("value/loss", 0.0) + float(loss.detach())
                for k, v in m.items():
                    totals[k] = totals.get(k, 0.0) + float(v) * share
            params = [p for p in critic.model.parameters() if p.requires_grad]
            clip = critic.config.grad_clip
            norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else float("inf"))
            totals["value/grad_norm"] = totals.get("value/grad_norm", 0.0) + float(norm)
            critic.optimizer.step()
            count += 1
    metrics.update({k: v / count for k, v in totals.items()})
    mask = batch.mask.bool()
    metrics["value/explained_var"] = explained_variance(scored.values, scored.returns, mask)
    metrics["value/returns_mean"] = float(scored.returns[mask].mean()) if mask.any() else 0.0
    metrics["value/values_mean"] = float(scored.values[mask].mean()) if mask.any() else 0.0


__all__ = ["Critic", "critic_update"]
