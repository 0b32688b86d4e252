"""GRPOTrainer: the public class and its loop; one iteration's phases live next door.

Per iteration (``step``), see :meth:`GRPOTrainer.train_step`:

- :mod:`portarl.trainer.rollout_phase`: ``prompts_per_step`` prompts (seeded by run seed
  and step), G completions each from the rollout engine (a seed per sample);
- :mod:`portarl.trainer.scoring`: rewards, old (and reference) log-probs through
  :mod:`portarl.ops`, advantages;
- :mod:`portarl.trainer.update`: ``ppo_epochs`` optimizer steps, each accumulating
  gradients over micro-batches of :func:`portarl.core.compute_loss` with global normalisers;
- :mod:`portarl.trainer.step_guard`: the guards, through all three.

Guards: every named tensor (reward, old_logp, ref_logp, advantage, loss, gradient) is
checked; a non-finite one skips the optimizer step with weights and optimizer state
untouched, counts it, logs it; ``guards.max_consecutive_skips`` in a row stop the run with
a checkpoint and :class:`TrainingStopped` naming the first bad tensor. KL and grad-norm
spikes and degenerate outputs are logged as events. Ctrl-C saves a checkpoint first.

Test hooks (:mod:`portarl.trainer.hooks`): ``trainer.hooks[point]`` (points: ``reward``,
``old_logp``, ``ref_logp``, ``advantage``, ``loss``, ``grad``) lists ``fn(step, tensor) ->
tensor`` applied at that point, e.g. to inject a NaN.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch

from portarl import distributed as pdist
from portarl.data import Example, arithmetic_examples, load_examples
from portarl.device import resolve_device
from portarl.emulation import resolve_profile
from portarl.rollout import SamplingParams
from portarl.tokenizer import as_codec
from portarl.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state
from portarl.trainer.config import TrainConfig
from portarl.trainer.guards import DegenerateDetector, NonFiniteError, SpikeDetector
from portarl.trainer.hooks import FAULT_ENV, HOOK_POINTS, apply_hooks, empty_hooks, install_fault_injection
from portarl.trainer.rollout_phase import run_rollout
from portarl.trainer.runlog import RunLogger, plot_curves, read_metrics, summarize
from portarl.trainer.scoring import compute_rewards, resolve_rewards, score
from portarl.trainer.sft import run_sft
from portarl.trainer.step_guard import StepGuard, finish_metrics, record_clean, record_skip
from portarl.trainer.setup import (
    SilentLogger,
    forced_backend,
    make_optimizer,
    make_precision,
    make_rollout_engine,
    place_model,
)
from portarl.trainer.update import run_update

log = logging.getLogger("portarl.train")

__all__ = ["FAULT_ENV", "HOOK_POINTS", "GRPOTrainer", "TrainResult", "TrainingStopped", "build_from_config"]


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


class GRPOTrainer:
    def __init__(self, model, tokenizer, reward_fns, train_data, config: TrainConfig | None = None, device="auto",
                 rollout_engine=None):
        self.config = (config or TrainConfig()).validate()
        # Under torchrun: process group (nccl / hccl / gloo), this rank's device, FSDP2.
        self.dist, self.device = pdist.init_distributed(resolve_device(device))
        self.model, self._initial_reference = place_model(model, self.config, self.dist, self.device)
        self.model.train()
        self.tokenizer = tokenizer
        self.codec = as_codec(tokenizer)
        self.reward_fns = resolve_rewards(reward_fns, self.config)
        self.examples: list[Example] = list(train_data)
        if not self.examples:
            raise ValueError("train_data is empty")
        self.output_dir = Path(self.config.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = CheckpointManager(self.output_dir, self.config.checkpoint.keep_last)
        self.precision = make_precision(self.model, self.config, self.dist)
        self.optimizer, self.scheduler = make_optimizer(self.precision.optimizer_params(), self.config)
        self._rollout = rollout_engine
        r = self.config.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                       max_new_tokens=r.max_new_tokens)
        g = self.config.guards
        self.kl_spikes = SpikeDetector("kl", g.spike_window, g.spike_min_history, g.spike_factor)
        self.grad_spikes = SpikeDetector("grad_norm", g.spike_window, g.spike_min_history, g.spike_factor)
        self.degenerate = DegenerateDetector(self.codec.eos_token_id, g.degenerate_min_tokens, g.degenerate_rise)
        self.hooks: dict[str, list] = empty_hooks()
        self.step = 0
        self.sft_done = self.config.train.sft_warmup_steps == 0
        self.skipped_total = 0
        self.consecutive_skips = 0
        self.streak_first_bad: str | None = None
        self.ref_model = None
        self._hook_step = 0
        self.guard = StepGuard(self.dist)
        self._local_offset = 0
        install_fault_injection(self.hooks, os.environ.get(FAULT_ENV), self.dist.rank)
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
            self._rollout = make_rollout_engine(self)
        return self._rollout

    @rollout.setter
    def rollout(self, engine) -> None:
        self._rollout = engine

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
        return apply_hooks(self.hooks, point, self._hook_step, tensor)

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
        self.precision = make_precision(self.model, self.config, self.dist)
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
    def _rewards(self, examples: list[Example], texts: list[str]) -> tuple[torch.Tensor, dict]:
        """The reward call: one value per completion (fp32, on the CPU) and ``reward/*`` metrics."""
        return compute_rewards(self.reward_fns, examples, texts, self.config.rollout.group_size)

    def train_step(self) -> dict:
        """Run iteration ``self.step + 1``; returns its metrics (``skipped`` = 1 when skipped).

        Phases: :func:`rollout_phase.run_rollout`, :func:`scoring.score`,
        :func:`update.run_update`; the guards (:mod:`portarl.trainer.step_guard`) run
        through all three."""
        step = self.step + 1
        self._hook_step = step
        started = time.perf_counter()
        phase = run_rollout(self, step)
        metrics, events = phase.metrics, phase.events
        skipped, overflow = False, False
        self.guard.reset()
        try:
            scored = score(self, phase, metrics)
            overflow = run_update(self, scored, metrics)
        except NonFiniteError as err:
            skipped = True
            record_skip(self, err, metrics, events)
        else:
            record_clean(self)
        finish_metrics(self, metrics, events, skipped, overflow)
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
        while self.step < cfg.train.steps:
            with forced_backend(cfg.precision.backend):
                metrics = self.train_step()
            events = metrics.pop("_events")
            logger.step(metrics)
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
            logger = SilentLogger()
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


def build_from_config(config: TrainConfig):
    """``(model, tokenizer, examples)`` as the config names them (built-in tiny model and
    synthetic arithmetic by default)."""
    from portarl.models import build_tiny, load_local

    m = config.model
    if m.path == "tiny":
        model, tokenizer = build_tiny(seed=m.init_seed, hidden_size=m.hidden_size, layers=m.layers, heads=m.heads,
                                      kv_heads=m.kv_heads, intermediate_size=m.intermediate_size)
    else:
        model, tokenizer = load_local(m.path)
    d = config.data
    if d.path is None:
        examples = arithmetic_examples(d.synthetic_size, seed=config.train.seed, max_operand=d.max_operand, ops=d.operators)
    else:
        examples = load_examples(d.path, prompt_field=d.prompt_field, answer_field=d.answer_field)
    return model, tokenizer, examples
