"""GRPOTrainer: rollout -> rewards -> log-probs -> advantages -> clipped policy updates.

Per iteration (``step``): sample ``prompts_per_step`` prompts (seeded by run seed and step),
G completions each from the rollout engine (a seed per sample), rewards, old (and
reference) log-probs through :mod:`portarl.ops`, advantages, then ``ppo_epochs`` optimizer
steps, each accumulating gradients over micro-batches of
:func:`portarl.core.compute_loss` with global normalisers.

Guards: every named tensor (reward, old_logp, ref_logp, advantage, loss, gradient) is
checked; a non-finite one skips the optimizer step with weights and optimizer state
untouched, counts it, logs it; ``guards.max_consecutive_skips`` in a row stop the run with
a checkpoint and :class:`TrainingStopped` naming the first bad tensor. KL and grad-norm
spikes and degenerate outputs are logged as events. Ctrl-C saves a checkpoint first.

Test hooks: ``trainer.hooks[point]`` (points: ``reward``, ``old_logp``, ``ref_logp``,
``advantage``, ``loss``, ``grad``) lists ``fn(step, tensor) -> tensor`` applied at that
point, e.g. to inject a NaN.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import random
import signal
import threading
import time
from pathlib import Path

import torch

from portarl.core import compute_advantages, compute_loss, kl_penalized_rewards, sequence_count, token_count
from portarl.data import Example, arithmetic_examples, encode_examples, load_examples
from portarl import distributed as pdist
from portarl.device import resolve_device
from portarl.emulation import resolve_profile
from portarl.reward_runner import RewardError, RewardRunner
from portarl.rollout import ENGINES, SamplingParams, identical_group_fraction, request_seeds
from portarl.tokenizer import as_codec, chat_template_option
from portarl.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state
from portarl.trainer.config import TrainConfig
from portarl.trainer.guards import (
    DegenerateDetector,
    NonFiniteError,
    SpikeDetector,
    check_finite,
    first_nonfinite_gradient,
)
from portarl.trainer.precision import DTYPES, PrecisionPlan
from portarl.trainer.runlog import RunLogger, plot_curves, read_metrics, summarize
from portarl.trainer.samples import SampleLog
from portarl.trainer.sequences import build_batch, completion_logits, completion_logprobs
from portarl.trainer.sft import run_sft

log = logging.getLogger("portarl.train")

HOOK_POINTS = ("reward", "old_logp", "ref_logp", "advantage", "loss", "grad")
FAULT_ENV = "PORTARL_FAULT_INJECT"


class TrainingStopped(RuntimeError):
    """The run stopped itself (persistent non-finite values); a checkpoint was saved."""

    def __init__(self, message: str, tensor_name: str, checkpoint: Path | None):
        super().__init__(message)
        self.tensor_name = tensor_name
        self.checkpoint = checkpoint


@dataclasses.dataclass
class TrainResult:
    steps: int
    checkpoint: Path | None
    summary: str


def _lr_lambda(cfg: TrainConfig, total: int):
    warm, floor = cfg.optim.warmup_steps, cfg.optim.min_lr_ratio

    def factor(i: int) -> float:
        if warm and i < warm:
            return (i + 1) / warm
        if cfg.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (i - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class GRPOTrainer:
    def __init__(self, model, tokenizer, reward_fns, train_data, config: TrainConfig | None = None, device="auto",
                 rollout_engine=None):
        self.config = (config or TrainConfig()).validate()
        # Under torchrun: process group (nccl / hccl / gloo), this rank's device, FSDP2.
        self.dist, self.device = pdist.init_distributed(resolve_device(device))
        dtype = DTYPES[self.config.precision.dtype]
        self._initial_reference = None
        if self.dist.enabled:
            self._check_distributed_config()
            if self.config.loss.kl_coef > 0:
                self._initial_reference = copy.deepcopy(model).to(self.device, dtype=dtype)
            if self.config.precision.master_weights_fp32 and dtype != torch.float32:
                self.model = pdist.shard(model.to(self.device, dtype=torch.float32), param_dtype=dtype)
            else:
                self.model = pdist.shard(model.to(self.device, dtype=dtype))
            if self._initial_reference is not None:
                for p in self._initial_reference.parameters():
                    p.requires_grad_(False)
                self._initial_reference = pdist.shard(self._initial_reference)
        else:
            self.model = model.to(self.device, dtype=dtype)
        self.model.train()
        self.tokenizer = tokenizer
        d = self.config.data
        self.codec = as_codec(tokenizer, chat_template=chat_template_option(d.chat_template), system_prompt=d.system_prompt)
        self.rewards = self._resolve_rewards(reward_fns)
        self.examples: list[Example] = list(train_data)
        self._prompt_ids = self._check_examples()
        self.output_dir = Path(self.config.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = CheckpointManager(self.output_dir, self.config.checkpoint.keep_last)
        if self.dist.enabled:  # FSDP2 holds the fp32 master copy (mixed-precision policy) when asked
            self.precision = PrecisionPlan(self.model, "fp32", False, None)
        else:
            self.precision = PrecisionPlan(self.model, self.config.precision.dtype,
                                           self.config.precision.master_weights_fp32, self.config.precision.loss_scale)
        o = self.config.optim
        self.optimizer = torch.optim.AdamW(self.precision.optimizer_params(), lr=o.lr, betas=(o.beta1, o.beta2),
                                           eps=o.eps, weight_decay=o.weight_decay)
        total = self.config.train.steps * self.config.train.ppo_epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(self.config, total))
        self._rollout = rollout_engine
        r = self.config.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                       max_new_tokens=r.max_new_tokens)
        g = self.config.guards
        self.kl_spikes = SpikeDetector("kl", g.spike_window, g.spike_min_history, g.spike_factor)
        self.grad_spikes = SpikeDetector("grad_norm", g.spike_window, g.spike_min_history, g.spike_factor)
        self.degenerate = DegenerateDetector(self.codec.eos_token_id, g.degenerate_min_tokens, g.degenerate_rise)
        self.hooks: dict[str, list] = {p: [] for p in HOOK_POINTS}
        self.step = 0
        self.sft_done = self.config.train.sft_warmup_steps == 0
        self.skipped_total = 0
        self.consecutive_skips = 0
        self.streak_first_bad: str | None = None
        self.ref_model = None
        self._hook_step = 0
        self._pending_bad = None
        self._local_offset = 0
        self._install_fault_injection(os.environ.get(FAULT_ENV))
        self.emulate = resolve_profile(self.config.precision.numerics)
        if self.emulate:
            log.warning("NPU numerics EMULATION on (%s): not portarl's fp32 path and not Ascend hardware",
                        ", ".join(sorted(self.emulate)))
        self._stop_requested = False

    # ------------------------------------------------------------------ set-up
    @property
    def rollout(self):
        """The rollout engine, built on first use (vllm: after any SFT warm-up, from the
        weights of that moment) unless one was passed in."""
        if self._rollout is None:
            self._rollout = self._make_rollout()
        return self._rollout

    def _make_rollout(self):
        if self.config.rollout.engine == "vllm":
            from portarl.rollout.vllm import engine_from_trainer

            return engine_from_trainer(self)
        engine = ENGINES["hf"](self.model, self.codec.stop_token_ids, self.codec.pad_token_id)
        if self.dist.enabled:  # FSDP forwards are collective: every rank decodes until all are done
            engine.finished_everywhere = lambda flag: not pdist.any_rank(self.dist, not flag)
        return engine

    @rollout.setter
    def rollout(self, engine) -> None:
        self._rollout = engine

    def _resolve_rewards(self, reward_fns) -> RewardRunner:
        if reward_fns is None:
            reward_fns = [(spec.name, spec.weight) for spec in self.config.rewards]
        dirs = [os.getcwd()] + [d for d in [getattr(self.config, "source_dir", None)] if d]
        return RewardRunner(reward_fns, search_dirs=dirs)

    def _check_examples(self) -> dict[int, list[int]]:
        """Every prompt encoded now (file:line in the error), answers present where needed,
        and sampling with replacement announced. Returns ids by ``id(example)``."""
        if not self.examples:
            raise ValueError("train_data is empty")
        ctx = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        ids = encode_examples(self.examples, self.codec, context_length=ctx,
                              max_new_tokens=self.config.rollout.max_new_tokens)
        need = self.rewards.needs_answer + (["train.sft_warmup_steps"] if self.config.train.sft_warmup_steps else [])
        missing = next((ex for ex in self.examples if ex.answer is None), None)
        if need and missing is not None:
            raise ValueError(f"{missing.where or 'an example'}: no answer field (data.answer_field="
                             f"{self.config.data.answer_field!r}), which {', '.join(need)} needs")
        n = self.config.train.prompts_per_step
        if n > len(self.examples) and self.dist.is_main:
            log.warning("train.prompts_per_step=%d is larger than the %d examples: prompts are drawn with replacement "
                        "(the same prompt can appear twice in a step)", n, len(self.examples))
        return {id(ex): p for ex, p in zip(self.examples, ids)}

    def _install_fault_injection(self, spec: str | None) -> None:
        """TEST ONLY: ``PORTARL_FAULT_INJECT="point@step[@rank]"`` puts a NaN into that tensor
        (``reward``, ``old_logp``, ``ref_logp``, ``advantage``, ``loss``, ``grad``) at that
        step, on one rank or all: how the subprocess tests reach the guards."""
        if not spec:
            return
        for item in spec.split(","):
            parts = item.strip().split("@")
            point, at_step = parts[0], int(parts[1])
            only_rank = int(parts[2]) if len(parts) > 2 else None
            if point not in HOOK_POINTS:
                raise ValueError(f"{FAULT_ENV}: {point!r} is not one of {', '.join(HOOK_POINTS)}")
            if only_rank is not None and only_rank != self.dist.rank:
                continue

            def poison(step, tensor, at_step=at_step):
                if step != at_step:
                    return tensor
                tensor = tensor.clone()
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                local.view(-1)[0] = float("nan")
                return tensor

            self.hooks[point].append(poison)
            log.warning("fault injection (test only): NaN into %s at step %d%s", point, at_step,
                        "" if only_rank is None else f" on rank {only_rank}")

    def _check_distributed_config(self) -> None:
        from portarl.trainer.config import ConfigError

        cfg, world = self.config, self.dist.world_size
        if cfg.train.prompts_per_step % world:
            raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple of the "
                              f"{world} ranks (each rank rolls out whole groups)")
        if cfg.precision.dtype == "fp16":
            raise ConfigError("precision.dtype=fp16 is not supported with several ranks yet (fp16 loss scaling under "
                              "FSDP2); use bf16")
        if cfg.train.sft_warmup_steps:
            raise ConfigError("train.sft_warmup_steps must be 0 with several ranks: run `portarl sft` once and set "
                              "model.path to its output")
        if cfg.rollout.engine != "hf":
            raise ConfigError("rollout.engine must be 'hf' with several ranks for now")

    def _uses_reference(self) -> bool:
        return self.config.loss.kl_coef > 0

    def _make_reference(self):
        if self._initial_reference is not None:  # distributed: the sharded copy made before training
            return self._initial_reference
        ref = copy.deepcopy(self.model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _apply_hooks(self, point: str, tensor: torch.Tensor) -> torch.Tensor:
        for fn in self.hooks[point]:
            tensor = fn(self._hook_step, tensor)
        return tensor

    # ------------------------------------------------------------- checkpoints
    def _state(self) -> dict:
        return {
            "step": self.step,
            "sft_done": self.sft_done,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            "rng": rng_state(),
            "kl_spikes": self.kl_spikes.state_dict(),
            "grad_spikes": self.grad_spikes.state_dict(),
            "degenerate": self.degenerate.state_dict(),
            "skipped_total": self.skipped_total,
            "consecutive_skips": self.consecutive_skips,
            "streak_first_bad": self.streak_first_bad,
            "ref_model": {k: v.detach().cpu() for k, v in self.ref_model.state_dict().items()} if self.ref_model is not None else None,
            "config": self.config.to_dict(),
        }

    def save_checkpoint(self) -> Path:
        if self.dist.enabled:
            state = self._state()
            state.pop("optimizer")  # in the DCP shards
            state["ref_model"] = None  # the reference is the initial model: rebuilt from model.path
            path = self.checkpoints.save_sharded(self.step, self.model, self.optimizer, self.tokenizer, state, self.dist)
            if self.dist.is_main:
                log.info("checkpoint saved (DCP, %d ranks): %s", self.dist.world_size, path)
            return path
        path = self.checkpoints.save(self.step, self.model, self.tokenizer, self._state())
        log.info("checkpoint saved: %s", path)
        return path

    def resume(self) -> int:
        """Load the latest complete checkpoint; returns its step (0 when there is none)."""
        if self.dist.enabled:
            pdist.barrier(self.dist)
        for removed in (self.checkpoints.clean_partial() if self.dist.is_main else []):
            log.warning("removed an incomplete checkpoint left by an interrupted write: %s", removed)
        latest = self.checkpoints.latest()
        if latest is None:
            log.info("no checkpoint in %s: starting from scratch", self.checkpoints.root)
            return 0
        state = self.checkpoints.load_state(latest)
        if self.checkpoints.is_sharded(latest):
            self.checkpoints.load_sharded(latest, self.model, self.optimizer)
            state["optimizer"] = self.optimizer.state_dict()
        else:
            self.checkpoints.load_weights(self.model, latest)
        self.precision = PrecisionPlan(self.model, self.config.precision.dtype, self.config.precision.master_weights_fp32,
                                       self.config.precision.loss_scale)
        self.precision.load_state_dict(state["precision"])
        if self.precision.use_master:
            self.optimizer.param_groups[0]["params"] = self.precision.optimizer_params()
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.kl_spikes.load_state_dict(state["kl_spikes"])
        self.grad_spikes.load_state_dict(state["grad_spikes"])
        self.degenerate.load_state_dict(state["degenerate"])
        self.step, self.sft_done = state["step"], state["sft_done"]
        self.skipped_total, self.consecutive_skips = state["skipped_total"], state["consecutive_skips"]
        self.streak_first_bad = state["streak_first_bad"]
        if state["ref_model"] is not None and not self.dist.enabled:
            self.ref_model = self._make_reference()
            self.ref_model.load_state_dict(state["ref_model"])
        log.info("resumed from %s (step %d)", latest, self.step)
        return self.step

    # ---------------------------------------------------------------- one step
    def _prompts_for_step(self, step: int) -> list[Example]:
        rng = random.Random(f"{self.config.train.seed}/prompts/{step}")
        n = self.config.train.prompts_per_step
        return rng.sample(self.examples, n) if n <= len(self.examples) else [rng.choice(self.examples) for _ in range(n)]

    def _rewards(self, examples: list[Example], texts: list[str]) -> tuple[torch.Tensor, dict]:
        """Weighted total per sample (:mod:`portarl.reward_runner`; a failing reward raises
        :class:`RewardError`). Keeps each function's values for the sample log."""
        g = self.config.rollout.group_size
        scores = self.rewards.score([examples[i // g] for i in range(len(texts))], texts)
        self._last_reward_values = scores.per_function
        return scores.total, scores.metrics

    def _logprobs(self, model, batch, *, with_entropy=False):
        return completion_logprobs(model, batch, temperature=self.config.rollout.temperature,
                                   logits_policy=self.config.precision.logits, with_entropy=with_entropy,
                                   emulate=self.emulate)

    def _no_grad_logprobs(self, model, batch) -> torch.Tensor:
        mb = self.config.train.micro_batch_size
        with torch.no_grad():
            parts = [self._logprobs(model, batch.rows(slice(i, i + mb))) for i in range(0, batch.labels.shape[0], mb)]
        return torch.cat(parts)

    _GUARD_ORDER = ("logits", "reward", "old_logp", "ref_logp", "advantage", "loss", "gradient")

    def _guard(self, name: str, tensor: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """check_finite; with several ranks the failure is only recorded, and every rank
        learns of it at the next :meth:`_sync_guard` (they must all reach the same collectives)."""
        if not self.dist.enabled:
            check_finite(name, tensor, mask)
            return
        try:
            check_finite(name, tensor, mask)
        except NonFiniteError:
            if self._pending_bad is None:
                self._pending_bad = name

    def _sync_guard(self) -> None:
        if not self.dist.enabled:
            return
        none = len(self._GUARD_ORDER)
        code = self._GUARD_ORDER.index(self._pending_bad) if self._pending_bad else none
        self._pending_bad = None
        first = pdist.first_code(self.dist, code)
        if first < none:
            raise NonFiniteError(self._GUARD_ORDER[first], "on at least one rank; every rank skips")

    def _blame_logits(self, batch, logp: torch.Tensor) -> None:
        """When log-probs are non-finite, name the logits if they are the source (the model
        itself produced NaN/inf: overflow in the forward, corrupted weights)."""
        if self.dist.enabled:
            return  # an extra forward on one rank only would break FSDP's collectives
        rows = torch.nonzero((~torch.isfinite(logp) & batch.mask).any(dim=-1)).flatten()
        with torch.no_grad():
            logits = completion_logits(self.model, batch.rows(rows), self.config.precision.logits)
        bad = ~torch.isfinite(logits).all(dim=-1) & batch.mask[rows]
        if bool(bad.any()):
            raise NonFiniteError("logits", f"{int(bad.sum())} positions in {rows.numel()} sequences")

    def _optimizer_step(self, batch, old_logp, ref_logp, rollout_logp, advantages) -> tuple[dict, bool]:
        """One optimizer step over the whole batch (micro-batched). Returns (metrics, overflow)."""
        cfg = self.config
        mb = cfg.train.micro_batch_size
        n = batch.labels.shape[0]
        counts = pdist.all_reduce(self.dist, torch.tensor([float(token_count(batch.mask)), float(sequence_count(batch.mask))]))
        norms = dict(num_global_tokens=int(counts[0]), num_global_seqs=int(counts[1]))
        want_entropy = True  # cheap with the fused op; logged, and in the loss when entropy_coef > 0
        self.precision.zero_grad()
        sums: dict[str, float] = {}
        for start in range(0, n, mb):
            rows = slice(start, start + mb)
            part = batch.rows(rows)
            out = self._logprobs(self.model, part, with_entropy=want_entropy)
            logp, entropy = out if want_entropy else (out, None)
            loss, metrics = compute_loss(
                logp, old_logp[rows], advantages[rows], part.mask, config=cfg.loss,
                ref_logp=None if ref_logp is None else ref_logp[rows],
                rollout_logp=None if rollout_logp is None else rollout_logp[rows],
                entropy=entropy, **norms,
            )
            loss = self._apply_hooks("loss", loss)
            self._guard("loss", loss)
            # FSDP2 averages gradients over ranks; each rank's loss is its share of the global
            # loss, so scale by the world size to reduce to the global batch's gradient.
            self.precision.scale_loss(loss * self.dist.world_size if self.dist.enabled else loss).backward()
            share = part.labels.shape[0] / n
            for k, v in metrics.items():
                if k == "loss" or k.endswith("/loss"):
                    sums[k] = sums.get(k, 0.0) + float(v)  # already a share of the batch loss
                else:
                    sums[k] = sums.get(k, 0.0) + share * float(v)
        params = self.precision.params
        if self.hooks["grad"] and params[0].grad is not None:
            params[0].grad = self._apply_hooks("grad", params[0].grad)
        bad = first_nonfinite_gradient(self.model)
        if self.dist.enabled:
            if bad is not None and self._pending_bad is None:
                self._pending_bad = "gradient"
            self._sync_guard()
        if bad is not None:
            if self.precision.dynamic:
                self.precision.update_scale(overflow=True)
                self.precision.zero_grad()
                return {**sums, "precision/overflow": 1.0, "precision/loss_scale": self.precision.scale}, True
            raise NonFiniteError("gradient", f"parameter {bad}")
        self.precision.unscale_grads()
        targets = self.precision.optimizer_params()
        clip = cfg.optim.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(targets, clip if clip is not None else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # DTensor under FSDP2: the global norm
            grad_norm = grad_norm.full_tensor()
        if not torch.isfinite(grad_norm):
            raise NonFiniteError("gradient", "norm")
        self.optimizer.step()
        self.rollout.mark_trainer_updated()
        self.scheduler.step()
        self.precision.after_step()
        self.precision.update_scale(overflow=False)
        self.precision.zero_grad()
        sums["grad_norm"] = float(grad_norm)
        sums["precision/loss_scale"] = self.precision.scale
        return sums, False

    def train_step(self) -> dict:
        """Run iteration ``self.step + 1``; returns its metrics (``skipped`` = 1 when skipped)."""
        cfg = self.config
        step = self.step + 1
        self._hook_step = step
        started = time.perf_counter()
        g = cfg.rollout.group_size
        everyone = self._prompts_for_step(step)
        seeds = request_seeds(cfg.train.seed, step, len(everyone), g, cfg.rollout.seed_mode)
        per_rank = len(everyone) // self.dist.world_size
        self._local_offset = self.dist.rank * per_rank
        examples = everyone[self._local_offset : self._local_offset + per_rank]  # whole groups per rank
        seeds = seeds[self._local_offset * g : (self._local_offset + per_rank) * g]
        prompts = [self._prompt_ids.get(id(ex)) or self.codec.encode_prompt(ex.prompt) for ex in examples for _ in range(g)]
        self.rollout.sync_weights(self.model)
        rollout = self.rollout.generate(prompts, seeds, self.sampling)
        self.rollout.sleep()  # the trainer computes now: the engine frees what it can (vLLM: KV cache)
        texts = [self.codec.decode(c) for c in rollout.completion_ids]
        metrics: dict = {"step": step, "phase": "grpo"}
        identical = identical_group_fraction(rollout.completion_ids, g)
        degenerate_frac, degenerate_event = self.degenerate.update(rollout.completion_ids)
        lengths = [len(c) for c in rollout.completion_ids]
        metrics.update({
            "rollout/identical_group_frac": identical, "rollout/degenerate_frac": degenerate_frac,
            "completion/len_mean": sum(lengths) / len(lengths),
            "completion/finished_frac": sum(rollout.finished) / len(rollout.finished),
        })
        events = []
        if identical > cfg.rollout.identical_warn_frac:
            events.append(("identical_samples", f"{identical:.0%} of groups have all-identical completions "
                           f"(seed_mode={cfg.rollout.seed_mode!r}; a constant seed per request gives identical samples)", {}))
        if degenerate_event:
            events.append(("degenerate_rise", f"degenerate completions (one token repeated) jumped to {degenerate_frac:.0%} "
                           f"from a median of {degenerate_event['median']:.0%}", degenerate_event))

        skipped, overflow = False, False
        self._pending_bad = None
        self._last_samples = None
        try:
            rewards, reward_metrics = self._rewards(examples, texts)
            self._last_samples = {"prompts": [examples[i // g].prompt_text for i in range(len(texts))],
                                  "completions": texts, "finished": rollout.finished, "rewards": self._last_reward_values,
                                  "total": rewards.tolist(), "advantages": None}
            metrics.update(reward_metrics)
            rewards = self._apply_hooks("reward", rewards)
            self._guard("reward", rewards)
            batch = build_batch(rollout.prompt_ids, rollout.completion_ids, self.codec.pad_token_id, self.device)
            rollout_logp = torch.zeros(batch.labels.shape, dtype=torch.float32)
            for i, lp in enumerate(rollout.logprobs):
                rollout_logp[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
            rollout_logp = rollout_logp.to(self.device)
            old_logp = self._apply_hooks("old_logp", self._no_grad_logprobs(self.model, batch))
            try:
                self._guard("old_logp", old_logp, batch.mask)
            except NonFiniteError:
                self._blame_logits(batch, old_logp)
                raise
            ref_logp = None
            if self._uses_reference():
                if self.ref_model is None:
                    self.ref_model = self._make_reference()
                ref_logp = self._apply_hooks("ref_logp", self._no_grad_logprobs(self.ref_model, batch))
                self._guard("ref_logp", ref_logp, batch.mask)
                if cfg.loss.kl_in_reward:
                    rewards, kl_metrics = kl_penalized_rewards(rewards.to(self.device), old_logp, ref_logp, batch.mask,
                                                               cfg.loss.kl_coef)
                    rewards = rewards.cpu()
                    metrics.update({k: float(v) for k, v in kl_metrics.items()})
            # Advantages see every sample of every group on every rank: gather the rewards.
            rewards = pdist.all_gather_cat(self.dist, rewards)
            self._sync_guard()
            metrics["reward/mean"] = float(rewards.mean())
            metrics["reward/std"] = float(rewards.std()) if rewards.numel() > 1 else 0.0
            adv = compute_advantages(rewards, g, cfg.loss.advantage_estimator, drop_zero_std=cfg.loss.drop_zero_std_groups,
                                     **cfg.loss.advantage_options())
            metrics.update({f"adv/{k}": float(v) for k, v in adv.metrics.items()})
            mine = slice(self._local_offset * g, (self._local_offset + len(examples)) * g)
            advantages = self._apply_hooks("advantage", adv.advantages[mine].to(self.device))
            check_finite("advantage", advantages)
            self._last_samples["advantages"] = advantages.cpu().tolist()
            # Dropped groups (DAPO dynamic sampling) are masked out, not removed, so every rank
            # runs the same number of micro-batches (FSDP forwards are collective).
            keep = adv.keep[mine].to(self.device)
            batch = dataclasses.replace(batch, mask=batch.mask & keep[:, None])
            for _ in range(cfg.train.ppo_epochs):
                step_metrics, overflow = self._optimizer_step(batch, old_logp, ref_logp, rollout_logp, advantages)
                metrics.update(step_metrics)
        except NonFiniteError as err:
            skipped = True
            self.precision.zero_grad()
            self.skipped_total += 1
            self.consecutive_skips += 1
            if self.consecutive_skips == 1:
                self.streak_first_bad = err.tensor_name
            metrics["guard/nonfinite_tensor"] = err.tensor_name
            events.append(("skipped_step", f"skipped the optimizer step: {err}; weights and optimizer state untouched", {}))
        else:
            self.consecutive_skips = 0
            self.streak_first_bad = None
        metrics["skipped"] = int(skipped)
        metrics["guard/skipped_total"] = self.skipped_total
        metrics["guard/consecutive_skips"] = self.consecutive_skips
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        kl = metrics.get("kl/value", metrics.get("pg/approx_kl", float("nan")))
        metrics["kl"] = kl
        metrics.setdefault("grad_norm", float("nan"))
        spike = 0
        if not skipped and not overflow:
            for detector, value in ((self.kl_spikes, kl), (self.grad_spikes, metrics["grad_norm"])):
                event = detector.update(value)
                if event:
                    spike = 1
                    events.append((event["kind"], f"{detector.name} spike: {value:.4g} > median {event['median']:.4g} + "
                                   f"{cfg.guards.spike_factor:g} x MAD {event['mad']:.3g}", event))
        metrics["guard/spike"] = spike
        metrics["time/step_s"] = time.perf_counter() - started
        if self.dist.enabled:
            for key in [k for k in metrics if k == "loss" or k.endswith("/loss")]:
                metrics[key] = metrics[key] * self.dist.world_size  # shares: the mean of world x share is the sum
            metrics = pdist.mean_metrics(self.dist, metrics)
        metrics["_events"] = events
        self.step = step
        return metrics

    # ------------------------------------------------------------------- loop
    def warmup_sft(self, logger: RunLogger | None = None) -> None:
        cfg = self.config.train
        if self.sft_done:
            return

        def on_step(step, loss):
            if logger is not None and (step % 10 == 0 or step == cfg.sft_warmup_steps):
                log.info("sft warm-up %d/%d: loss %.4f", step, cfg.sft_warmup_steps, loss)

        run_sft(self.model, self.codec, self.examples, steps=cfg.sft_warmup_steps, batch_size=cfg.sft_batch_size,
                lr=cfg.sft_lr, device=self.device, seed=cfg.seed, on_step=on_step, logits_policy=self.config.precision.logits)
        self.sft_done = True

    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint, and raise KeyboardInterrupt (Ctrl-C)."""
        self._stop_requested = True

    def _stop_requested_anywhere(self) -> bool:
        """A stop is collective: a rank that saw Ctrl-C (or a scheduler's signal) before the
        others must not save alone, since saving is a collective (DCP) and the others would
        wait in the next step's collectives forever. One all-reduce per step."""
        if not self.dist.enabled:
            return self._stop_requested
        self._stop_requested = pdist.any_rank(self.dist, self._stop_requested)
        return self._stop_requested

    def close(self) -> None:
        """Release the rollout engine (vLLM: its processes and device memory). The trainer
        can train again afterwards; a vllm engine then starts anew."""
        if self._rollout is not None:
            self._rollout.close()
            self._rollout = None

    @contextlib.contextmanager
    def _graceful_sigint(self):
        """First Ctrl-C: stop after the current step (never half a step). Second: at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self._stop_requested:
                raise KeyboardInterrupt
            log.warning("Ctrl-C: finishing step %d, then saving a checkpoint (Ctrl-C again to abort now)", self.step + 1)
            self._stop_requested = True

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _run_loop(self, logger: RunLogger, last_ckpt: Path | None) -> Path | None:
        cfg = self.config
        if not self.sft_done:
            self.warmup_sft(logger)
            self.ref_model = self._make_reference() if self._uses_reference() else None
        elif self._uses_reference() and self.ref_model is None:
            self.ref_model = self._make_reference()
        samples = SampleLog(self.output_dir, cfg.logging.samples_every, cfg.logging.samples_count,
                            getattr(logger, "writer", None)) if self.dist.is_main else None
        while self.step < cfg.train.steps:
            try:
                with _forced_backend(cfg.precision.backend):
                    metrics = self.train_step()
            except RewardError as err:
                # Nothing of this step was applied: the checkpoint is the last good step.
                last_ckpt = self.save_checkpoint()
                message = f"stopping at step {self.step + 1}: {err}. Checkpoint of step {self.step}: {last_ckpt}"
                logger.event(self.step + 1, "stopped", message)
                raise TrainingStopped(message, "reward", last_ckpt) from err
            events = metrics.pop("_events")
            logger.step(metrics)
            if samples is not None and samples.due(self.step) and self._last_samples is not None:
                samples.write(self.step, self._last_samples)
            for kind, message, fields in events:
                logger.event(self.step, kind, message, **{k: v for k, v in fields.items() if k != "kind"})
            if self.consecutive_skips >= cfg.guards.max_consecutive_skips:
                last_ckpt = self.save_checkpoint()
                message = (f"stopping at step {self.step}: {self.consecutive_skips} steps in a row skipped; the first "
                           f"non-finite tensor was {self.streak_first_bad}. Checkpoint: {last_ckpt}")
                logger.event(self.step, "stopped", message)
                raise TrainingStopped(message, self.streak_first_bad or "unknown", last_ckpt)
            if self.step % cfg.checkpoint.every == 0 or self.step == cfg.train.steps:
                last_ckpt = self.save_checkpoint()
            if self._stop_requested_anywhere():
                if self.checkpoints.latest() != self.checkpoints.root / f"step-{self.step:06d}":
                    last_ckpt = self.save_checkpoint()
                logger.event(self.step, "interrupted", f"stopped on request after step {self.step}; checkpoint {last_ckpt}")
                raise KeyboardInterrupt
        return last_ckpt

    def train(self, resume: bool = False) -> TrainResult:
        cfg = self.config
        if resume:
            self.resume()
        else:
            self.checkpoints.clean_partial()
        if self.dist.is_main:
            cfg.save(self.output_dir / "config.yaml")
            logger = RunLogger(self.output_dir, total_steps=cfg.train.steps, resume_step=self.step,
                               tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress)
        else:  # only rank 0 writes logs
            logger = _SilentLogger()
        last_ckpt = self.checkpoints.latest()
        self._stop_requested = False
        try:
            with self._graceful_sigint():
                last_ckpt = self._run_loop(logger, last_ckpt)
        finally:
            logger.close()
        if not self.dist.is_main:
            return TrainResult(self.step, last_ckpt, "")
        rows = read_metrics(self.output_dir / "metrics.jsonl")
        summary = summarize(rows)
        (self.output_dir / "summary.txt").write_text(summary + "\n")
        if cfg.logging.plot:
            plot_curves(rows, self.output_dir / "curves.png")
        return TrainResult(self.step, last_ckpt, summary)


class _SilentLogger:
    """What ranks other than 0 log: nothing."""

    def step(self, metrics):
        pass

    def event(self, *args, **kwargs):
        pass

    def close(self):
        pass


@contextlib.contextmanager
def _forced_backend(name: str | None):
    """Route every portarl op to one backend (``precision.backend``) for the duration."""
    if name is None:
        yield
        return

    from portarl.backends import BACKEND_ENV

    previous = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = previous


def build_from_config(config: TrainConfig):
    """``(model, tokenizer, examples)`` as the config names them (built-in tiny model and
    synthetic arithmetic by default)."""
    from portarl.models import build_tiny, load_local

    m = config.model
    if m.path == "tiny":
        model, tokenizer = build_tiny(seed=m.init_seed, hidden_size=m.hidden_size, layers=m.layers, heads=m.heads,
                                      kv_heads=m.kv_heads, intermediate_size=m.intermediate_size)
    else:
        model, tokenizer = load_local(m.path, dtype=DTYPES[config.precision.dtype])
    d = config.data
    if d.path is None:
        examples = arithmetic_examples(d.synthetic_size, seed=config.train.seed, max_operand=d.max_operand, ops=d.operators)
    else:
        examples = load_examples(d.path, prompt_field=d.prompt_field, answer_field=d.answer_field)
    return model, tokenizer, examples
