"""GRPOTrainer: the public class and its loop; one iteration's phases live next door.

Per iteration (``step``), see :meth:`GRPOTrainer.train_step`:

- :mod:`portarl.trainer.phases.rollout`: ``prompts_per_step`` prompts (seeded by run seed
  and step), G completions each from the rollout engine (a seed per sample);
- :mod:`portarl.trainer.phases.scoring`: rewards, old (and reference) log-probs through
  :mod:`portarl.ops`, advantages;
- :mod:`portarl.trainer.phases.update`: ``ppo_epochs`` optimizer steps, each accumulating
  gradients over micro-batches of :func:`portarl.core.compute_loss` with global normalisers;
- :mod:`portarl.trainer.guards.step_guard`: the guards, through all three.

Guards: every named tensor (reward, old_logp, ref_logp, advantage, loss, gradient) is
checked; a non-finite one skips the optimizer step with weights and optimizer state
untouched, counts it, logs it; ``guards.max_consecutive_skips`` in a row stop the run with
a checkpoint and :class:`TrainingStopped` naming the first bad tensor. KL and grad-norm
spikes and degenerate outputs are logged as events. SIGINT and SIGTERM save a checkpoint
first (:mod:`portarl.trainer.run.signals`).

Test hooks (:mod:`portarl.trainer.guards.hooks`): ``trainer.hooks[point]`` (points: ``reward``,
``old_logp``, ``ref_logp``, ``advantage``, ``loss``, ``grad``) lists ``fn(step, tensor) ->
tensor`` applied at that point, e.g. to inject a NaN.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from pathlib import Path

import torch

from portarl.runtime import blackbox
from portarl.runtime import distributed as pdist
from portarl.assets.data import Example
from portarl.backends.device import resolve_device
from portarl.backends.emulation import resolve_profile
from portarl.assets.lora import is_lora
from portarl.assets.reward_runner import RewardError, RewardRunner
from portarl.rollout import SamplingParams
from portarl.multiturn.agent import make_agent
from portarl.assets.tokenizer import chat_template_option
from portarl.vision.codec import codec_for
from portarl.vision.models import vision_refusal
from portarl.runtime.user_code import UserCodeGuard, agree_on_failure
from portarl.trainer.checkpoint import CheckpointManager
from portarl.moe.load import router_aux_refusal
from portarl.trainer.config import ConfigError, TrainConfig
from portarl.core.kl_control import make_kl_controller
from portarl.trainer.guards.detectors import DegenerateDetector, SpikeDetector
from portarl.trainer.phases.packing import resolve_padding_free
from portarl.trainer.guards.hooks import FAULT_ENV, HOOK_POINTS, apply_hooks, empty_hooks, install_fault_injection
from portarl.trainer.run import persistence
from portarl.trainer.run import lock as run_lock
from portarl.trainer.run.shared_dir import check_shared_output_dir
from portarl.trainer.run.logger import RunLogger
from portarl.trainer.phases.evaluation import Evaluator
from portarl.trainer.phases.reference import refuse_reference_sync
from portarl.trainer.phases.sft import demonstrations, warm_up
from portarl.trainer.guards.step_guard import StepGuard
from portarl.trainer.start.setup import (
    check_demonstrations,
    check_examples,
    make_optimizer,
    make_precision,
    make_rollout_engine,
    place_model,
    sequence_parallel,
)
from portarl.trainer.loop import TrainingStopped
from portarl.trainer.phases.iteration import run_iteration
from portarl.trainer.run.session import train_run
from portarl.trainer.start.build import build_examples, build_from_config, build_policy  # noqa: F401 (their home before)

log = logging.getLogger("portarl.train")

__all__ = ["FAULT_ENV", "HOOK_POINTS", "GRPOTrainer", "TrainResult", "TrainingStopped", "build_examples",
           "build_from_config", "build_policy"]


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
        self.dist, self.device = pdist.init_distributed(resolve_device(device), self.config.distributed.timeout_s,
                                                           fsdp_one_rank=self.config.distributed.fsdp_one_rank)
        if self.config.rollout.dynamic_sampling and self.dist.enabled:
            raise ConfigError("rollout.dynamic_sampling runs in a single process (under torchrun each rank would keep "
                              "a different number of groups); use loss.drop_zero_std_groups there")
        if (why := refuse_reference_sync(self.config, model, self.dist.enabled)) is not None:
            raise ConfigError(why)
        self.sp = sequence_parallel(self.config, model, self.dist)  # this rank's Ulysses group, or None
        # loss.advantage_estimator=gae: the value model starts from the policy as given (phases/critic.py)
        critic_source = copy.deepcopy(model) if self.config.loss.advantage_estimator == "gae" else None
        self.model, self._initial_reference = place_model(model, self.config, self.dist, self.device)
        if (why := router_aux_refusal(self.config, self.model)) is not None:
            raise ConfigError(why)
        self.model.train()
        from portarl.moe.routing import install

        if self.config.rollout.routing_replay != "off":
            if not install(self.model):  # the routers' replayable forward
                raise ConfigError(f"rollout.routing_replay={self.config.rollout.routing_replay}: the model has no "
                                  "mixture-of-experts routers to replay; set rollout.routing_replay=off")
        self.padding_free = resolve_padding_free(self.config, self.model)  # micro-batch layout (trainer/phases/packing.py)
        self.tokenizer = tokenizer
        d = self.config.data
        self.codec = codec_for(tokenizer, self.model, chat_template=chat_template_option(d.chat_template),
                              system_prompt=d.system_prompt)
        if hasattr(self.codec, "encode_example") and (why := vision_refusal(self.config)) is not None:
            raise ConfigError(why)
        # tools / environment: multi-turn episodes (portarl.multiturn); sets the codec's tools
        self.agent = make_agent(self.config, self.codec, self._search_dirs())
        self.rewards = self._resolve_rewards(reward_fns)
        self.critic = None
        if critic_source is not None:
            from portarl.trainer.phases.critic import Critic

            self.critic = Critic(self, critic_source)
            del critic_source
        self.teacher = None  # loss.distill: the frozen teacher (phases/distill.py), never in checkpoints
        if self.config.loss.distill is not None:
            from portarl.trainer.phases.distill import load_teacher

            self.teacher = load_teacher(self)
        self.examples: list[Example] = list(train_data)
        # Every prompt encoded and checked now, by id(example): encoded_prompt()
        self._prompt_ids = check_examples(self.examples, self.codec, self.model, self.config, self.rewards.needs_answer,
                                          self.dist.is_main)
        # The warm-up's rows (data.sft_path, else the GRPO prompts); a file of their own is checked now.
        self.sft_examples = demonstrations(self.config, self.examples) if self.config.train.sft_warmup_steps else []
        if self.config.data.sft_path is not None and self.config.train.sft_warmup_steps:
            check_demonstrations(self.sft_examples, self.codec, self.config)
        if self.config.eval.data is not None and self.dist.enabled:
            raise ConfigError("eval.data under torchrun is not supported yet: evaluate checkpoints with "
                              "`portarl eval --checkpoint C --data F`, or train in one process")
        self.evaluator = Evaluator(self) if self.config.eval.data is not None else None  # checks the file now
        self.last_samples = None  # what the sample log shows of the last step (trainer.scoring fills it)
        self.output_dir = Path(self.config.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        check_shared_output_dir(self.output_dir, self.dist)  # several nodes: one directory every rank sees
        self.checkpoints = CheckpointManager(self.output_dir, self.config.checkpoint.keep_last)
        self.precision = make_precision(self.model, self.config, self.dist)
        self.optimizer, self.scheduler = make_optimizer(self.precision.optimizer_params(), self.config)
        self._rollout = rollout_engine
        self.async_rollout = None  # rollout.mode=async: the running pipeline (trainer.asynchronous.pipeline)
        self.async_in_flight = None  # --resume in async mode: the checkpoint's batches in flight (trainer.asynchronous.resume)
        r = self.config.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                       max_new_tokens=r.max_new_tokens)
        g = self.config.guards
        self.kl_spikes = SpikeDetector("kl", g.spike_window, g.spike_min_history, g.spike_factor, g.kl_ceiling,
                                       g.kl_floor, g.spike_ratio)
        self.grad_spikes = SpikeDetector("grad_norm", g.spike_window, g.spike_min_history, g.spike_factor,
                                         g.grad_norm_ceiling, g.grad_norm_floor, g.spike_ratio)
        self.kl_ctl = make_kl_controller(self.config.loss)
        self.degenerate = DegenerateDetector(self.codec.eos_token_id, g.degenerate_min_tokens, g.degenerate_rise)
        self.hooks: dict[str, list] = empty_hooks()
        self.hook_guard = UserCodeGuard(self.config.train.reward_timeout_s, "train.reward_timeout_s")
        self.param_names = [n for n, p in self.model.named_parameters() if p.requires_grad]  # optimizer order
        self.stop_reason: str | None = None  # set by a guard with action "stop"
        self.partial_update = None  # the guard error that ended an iteration after some optimizer steps
        self.refused_checkpoint: str | None = None  # why the last save_checkpoint wrote nothing
        self.step = 0
        #: experiment tracker -> its run's id (rank 0's; kept in checkpoints so --resume continues those runs)
        self.tracker_runs: dict[str, str] = {}
        self.sft_done = self.config.train.sft_warmup_steps == 0
        self.skipped_total = 0
        self.consecutive_skips = 0
        self.streak_first_bad: str | None = None
        self.ref_model = None
        self.hook_step = 0  # the step the test hooks see (run_hooks)
        self.guard = StepGuard(self.dist)
        self.budget_warned = False  # micro_batches' token-budget warning: once per run
        install_fault_injection(self.hooks, os.environ.get(FAULT_ENV), self.dist.rank)
        self.emulate = resolve_profile(self.config.precision.numerics)
        if self.emulate:
            log.warning("NPU numerics EMULATION on (%s): not portarl's fp32 path and not Ascend hardware",
                        ", ".join(sorted(self.emulate)))
        # A stop asked for (request_stop, a signal: trainer.signals) and the signal, an int once one arrives.
        self.stop_requested, self.stop_signal = False, None
        if self.config.precision.dtype != "fp32" and not self.config.precision.use_master:
            log.warning("precision.master_weights_fp32=false with %s: the optimizer steps the %s weights themselves, "
                        "so updates below their resolution are lost (see update/lost_frac); the default 'auto' keeps "
                        "fp32 master weights and optimizer state", self.config.precision.dtype, self.config.precision.dtype)

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

    @property
    def rollout_if_built(self):
        """The rollout engine if one was built or passed in, else None (builds nothing)."""
        return self._rollout

    def _resolve_rewards(self, reward_fns) -> RewardRunner:
        self.rewards_from_config = reward_fns is None  # the config's rewards (what async mode's worker can load)
        if reward_fns is None:  # reward models load here, on this rank's device unless their own device is named
            reward_fns = self.config.rewards
        # async mode: the worker scores and loads them; here only eval.data would (at its first score)
        load = "lazy" if self.config.rollout.mode == "async" else True
        return RewardRunner(reward_fns, search_dirs=self._search_dirs(), timeout_s=self.config.train.reward_timeout_s,
                            device=self.device, precision_dtype=self.config.precision.dtype, load=load)

    def _search_dirs(self) -> list[str]:
        """Where ``module:function`` rewards, tools and environments are looked for."""
        return self.config.code_search_dirs()

    def encoded_prompt(self, example: Example) -> list[int]:
        """``example``'s prompt ids: encoded and checked when the data loaded, else now."""
        return self._prompt_ids.get(id(example)) or self.codec.encode_prompt(example.prompt)

    def vision_inputs(self, examples: list, group_size: int):
        """``build_batch``'s / the rollout's vision inputs for ``examples`` sampled
        ``group_size`` times each; None for a text model."""
        batch_vision = getattr(self.codec, "batch_vision", None)
        return None if batch_vision is None else batch_vision(examples, group_size)

    def media_for(self, examples: list, group_size: int) -> dict:
        """The rollout engine's extra keywords for ``examples`` sampled ``group_size`` times
        each: ``{"media": VisionBatch}`` for a vision-language model, else none."""
        vision = self.vision_inputs(examples, group_size)
        return {} if vision is None else {"media": vision}

    def uses_reference(self) -> bool:
        """Whether the loss needs a reference model (``loss.kl_coef > 0``)."""
        return self.config.loss.kl_coef > 0

    def make_reference(self):
        """A frozen reference copy of the policy (FSDP2: the sharded copy made at start;
        LoRA: none, the adapter disabled is the reference)."""
        if self._initial_reference is not None or is_lora(self.model):  # FSDP2: the sharded copy; LoRA: none
            return self._initial_reference  # (LoRA's reference is the adapter disabled: trainer/phases/reference.py)
        ref = copy.deepcopy(self.model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def loss_config(self):
        """The loss config of this iteration: ``config.loss`` with the KL controller's coefficient."""
        if self.kl_ctl.value == self.config.loss.kl_coef:
            return self.config.loss
        return dataclasses.replace(self.config.loss, kl_coef=self.kl_ctl.value)

    def run_hooks(self, point: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` through the test hooks at ``point`` (:mod:`portarl.trainer.guards.hooks`)."""
        return apply_hooks(self.hooks, point, self.hook_step, tensor, self.hook_guard)

    # ------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of this step (:func:`persistence.save_checkpoint`: refused
        while a weight or fp32 master is not finite)."""
        blackbox.note(phase="checkpoint")
        return persistence.save_checkpoint(self)

    def resume(self) -> int:
        """Load the latest verified checkpoint (:func:`persistence.resume`); returns its step."""
        return persistence.resume(self)

    # ---------------------------------------------------------------- one step
    def score_rewards(self, examples: list[Example], texts: list[str], rows: list[Example] | None = None):
        """The reward call: the runner's scores (:mod:`portarl.assets.reward_runner`): ``total``, the
        weighted total per completion (fp32, on the CPU), ``metrics`` (``reward/*``) and
        ``per_function`` (each function's values, for the sample log). A failing reward on
        any rank raises :class:`RewardError` on every rank. ``rows``: one row per sample
        (multi-turn episodes add columns: :func:`portarl.trainer.phases.episodes.reward_examples`)."""
        g = self.config.rollout.group_size
        scores = failure = None
        try:
            scores = self.rewards.score(rows or [examples[i // g] for i in range(len(texts))], texts)
        except RewardError as err:
            failure = err
        failure = agree_on_failure(self.dist, failure, RewardError)  # one rank's failure stops every rank
        if failure is not None:
            raise failure
        return scores

    def train_step(self) -> dict:
        """Run iteration ``self.step + 1``; returns its metrics (``skipped`` = 1 when skipped).

        Phases (:func:`portarl.trainer.phases.iteration.run_iteration`): rollout, scoring, the
        update (and the value model's); the guards run through all of them."""
        return run_iteration(self)

    # ------------------------------------------------------------------- loop
    def warmup_sft(self, logger: RunLogger | None = None) -> None:
        """The supervised warm-up (``train.sft_warmup_steps``), once: :func:`sft.warm_up`."""
        if self.sft_done:
            return
        blackbox.note(phase="sft warm-up")
        losses = warm_up(self, logger)
        if self.critic is not None and losses:  # the value model starts from the warmed-up policy
            self.critic.sync_from(self.model)
        if self._initial_reference is not None and losses:  # FSDP2: the sharded copy was made before the
            with torch.no_grad():  # warm-up; one process builds its reference after it: anchor the warmed-up model
                for ref, param in zip(self._initial_reference.parameters(), self.model.parameters(), strict=True):
                    ref.copy_(param)  # shard to shard (the same FSDP2 layout), in the reference's dtype
        self.sft_done = True

    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint, and raise StopRequested (a
        KeyboardInterrupt), as on SIGINT or SIGTERM."""
        self.stop_requested = True

    def stop_requested_anywhere(self) -> bool:
        """A stop is collective: a rank that saw Ctrl-C (or a scheduler's signal) before the
        others must not save alone, since saving is a collective (DCP) and the others would
        wait in the next step's collectives forever. One all-reduce per step.

        The answer is exactly the collective's, so every rank acts alike; the local request
        is only ever raised here, never cleared: a signal handled while this rank waits in
        the all-reduce (after it sent its False) must survive to the next step's agreement.
        Assigning the collective's False over it lost such a signal, and the run trained on."""
        if not self.dist.enabled:
            return self.stop_requested
        anywhere = pdist.any_rank(self.dist, self.stop_requested)
        if anywhere:
            self.stop_requested = True
        return anywhere

    def close(self) -> None:
        """Release the rollout engine (vLLM: its processes and device memory) and stop the
        user-code watchdogs. The trainer can train again afterwards; a vllm engine then
        starts anew."""
        self.rewards.close()
        self.hook_guard.close()
        if self._rollout is not None:
            self._rollout.close()
            self._rollout = None
        if self.agent is not None:  # process isolation: its tool process (started again on use)
            self.agent.close()

    def train(self, resume: bool = False, overwrite: bool = False, start_if_none: bool = False) -> TrainResult:
        """Train to ``train.steps``. A directory holding another run is refused unless
        ``resume`` (continue it; mid-run settings applied, others refused; no checkpoint
        there is refused too, unless ``start_if_none``) or ``overwrite`` (delete it first):
        see :mod:`portarl.trainer.run.output_dir`."""
        with run_lock.held(self.output_dir, self.dist.is_main):  # one run per directory (a no-op under the CLI's)
            steps, last_ckpt, summary = train_run(self, resume, overwrite, start_if_none)
        return TrainResult(steps, last_ckpt, summary)
