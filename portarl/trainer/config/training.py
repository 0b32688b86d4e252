"""The ``train`` and ``optim`` sections of the training configuration: the step's shape
(prompts, micro-batches, warm-up, steps) and the optimizer (public through
:mod:`portarl.trainer.config`)."""

from __future__ import annotations

import dataclasses

from portarl.assets.reward_runner import DEFAULT_TIMEOUT_S
from portarl.trainer.config.fields import _check, _number, _positive_int


@dataclasses.dataclass
class TrainSection:
    #: GRPO iterations (each: rollout, rewards, advantages, ppo_epochs optimizer steps).
    steps: int = 300
    #: Prompts per GRPO iteration (each sampled group_size times), across all ranks.
    prompts_per_step: int = 16
    #: mu: passes over each rollout batch.
    ppo_epochs: int = 1
    #: Optimizer steps per pass: the rollout batch is shuffled (run seed, step, epoch) and
    #: split into this many mini-batches, each normalised by its own global token /
    #: sequence counts. Optimizer steps per iteration: mini_batches x ppo_epochs.
    mini_batches: int = 1
    #: Sequences per forward/backward; gradients accumulate over the batch.
    micro_batch_size: int = 64
    #: Run seed: prompt order, per-sample sampling seeds and mini-batch shuffles derive from it;
    #: Python's, NumPy's and torch's global generators (what user rewards draw from) are seeded
    #: with it at the start of a run, and restored from the checkpoint on --resume.
    seed: int = 0
    #: Supervised warm-up steps on (prompt, answer) before GRPO (0: none).
    sft_warmup_steps: int = 40
    #: SFT (warm-up and portarl sft): examples per step.
    sft_batch_size: int = 64
    #: SFT (warm-up and portarl sft): learning rate.
    sft_lr: float = 3e-3
    #: Old (behaviour-policy) log-probs: "auto" takes them from the training forward
    #: (detached) when the rollout sampled the trainer's current weights and the batch gets
    #: one optimizer step (ppo_epochs x mini_batches = 1), saving a no-grad forward per
    #: step; "recompute" always runs that forward. See portarl.trainer.phases.scoring.
    old_logprobs: str = "auto"
    #: The fused linear log-probs head on a CUDA GPU (:mod:`portarl.backends.cuda.linear_heads`):
    #: "auto" times the split-vocabulary Triton head, cuBLAS on fixed-shape chunks and the
    #: chunked Triton tile once per (GPU, dtype, H, V) at the run's start, keeps the fastest
    #: (cached across runs) and logs the timings; "split", "cublas" or "tile" forces one.
    #: Every head is batch invariant and held to the same float64 contract; other devices
    #: ignore it.
    linear_head: str = "auto"
    #: Activation checkpointing per decoder layer (non-reentrant; :mod:`portarl.trainer.memory.checkpointing`):
    #: "auto" (on for every model not built in by portarl, off for the tiny demo model),
    #: true or false. Saves about layers x the activations for about one more forward.
    gradient_checkpointing: str | bool = "auto"
    #: Token budget of one micro-batch (verl's ``ppo_max_token_len_per_gpu``): rows sorted
    #: by length are packed while rows x (longest prompt + longest completion) <= this (and
    #: rows <= micro_batch_size), each micro-batch padded only to its own longest row
    #: (padding-free: while the tokens its packed rows compute <= this); the
    #: no-grad scoring forwards (old / reference log-probs) use the same packs. None: fixed
    #: micro_batch_size slices. 16384 (verl's default): the README's own-data settings
    #: (64 rows of ~100 tokens) stay one 64-row micro-batch, while long completions (4k
    #: tokens) get 4 rows per micro-batch instead of 64. A row longer than the budget runs
    #: alone (warned). See :mod:`portarl.trainer.phases.micro_batches`; `portarl plan` says what fits.
    max_tokens_per_micro_batch: int | None = 16384
    #: Seconds one call into user code (a reward function, per sample or per batch; a
    #: trainer hook) may take before the run stops with a checkpoint and a line naming the
    #: function, the sample and its prompt (exit 3), in colocated and async mode alike.
    #: 300: the built-in rewards take milliseconds per batch (measured in docs/checkpoints.md),
    #: so only a hang or a slow remote judge reaches it; below distributed.timeout_s, so that
    #: under torchrun the hang is named before the other ranks' collective times out.
    reward_timeout_s: float = DEFAULT_TIMEOUT_S
    #: Padding-free micro-batches (:mod:`portarl.trainer.phases.packing`): each micro-batch's
    #: sequences back to back without pad tokens, position ids restarting per sequence,
    #: through transformers' packed-sequence path (a block-diagonal mask for sdpa / eager /
    #: flex attention, the varlen kernel for flash_attention_2/3/4: flash-attn on CUDA,
    #: npu_fusion_attention TND on Ascend); the token budget then counts real tokens. No
    #: micro-batch holds an attention mask over 64 MiB (:mod:`portarl.trainer.phases.attention_masks`:
    #: flex gets a block mask, sdpa rows over it one sequence each without a mask).
    #: "auto": on where the model's attention supports it, else padded (logged once);
    #: true: refuse a model without support; false: the padded layout.
    padding_free: str | bool = "auto"
    #: Shared-prompt rows (:mod:`portarl.trainer.phases.share_prompt`): on padding-free rows,
    #: the samples of a group hold their prompt once (each completion attends to it and to
    #: itself under an explicit 4-D mask, a block mask for flex), where that computes less
    #: than one row per sample and its dense mask stays within 64 MiB.
    #: "auto": on with sdpa / eager / flex attention on padding-free rows, else off; true:
    #: refuse anything else (flash attention, padding_free off); false: every sample whole.
    share_prompt: str | bool = "auto"
    #: Ulysses sequence parallelism (:mod:`portarl.trainer.phases.ulysses`; verl's
    #: ``ulysses_sequence_parallel_size``): under torchrun, groups of this many consecutive
    #: ranks share their rows, each row cut along the sequence into this many shards, one
    #: per rank, with an all-to-all over the attention heads around attention; the world
    #: size / this many data-parallel groups split the prompts. 1: off. Needs sdpa
    #: attention and a head count it divides; max_tokens_per_micro_batch stays per rank
    #: (a micro-batch's rows may hold this many times the tokens).
    sequence_parallel_size: int = 1

    def validate(self):
        _check(isinstance(self.gradient_checkpointing, bool) or self.gradient_checkpointing == "auto",
               "train.gradient_checkpointing", "must be auto, true or false", self.gradient_checkpointing)
        _check(isinstance(self.padding_free, bool) or self.padding_free == "auto", "train.padding_free",
               "must be auto, true or false", self.padding_free)
        _check(isinstance(self.share_prompt, bool) or self.share_prompt == "auto", "train.share_prompt",
               "must be auto, true or false", self.share_prompt)
        _positive_int(self, "train", *(["max_tokens_per_micro_batch"] if self.max_tokens_per_micro_batch is not None
                                       else []))
        _check(self.old_logprobs in ("auto", "recompute"), "train.old_logprobs", "must be 'auto' or 'recompute'",
               self.old_logprobs)
        _check(self.linear_head in ("auto", "split", "cublas", "tile"), "train.linear_head",
               "must be auto, split, cublas or tile", self.linear_head)
        _positive_int(self, "train", "steps", "prompts_per_step", "ppo_epochs", "mini_batches", "micro_batch_size",
                      "sft_batch_size", "sequence_parallel_size")
        _positive_int(self, "train", "sft_warmup_steps", "seed", allow_zero=True)
        _number(self, "train", "sft_lr", low=0.0)
        _number(self, "train", "reward_timeout_s", low=0.0)


@dataclasses.dataclass
class OptimConfig:
    #: AdamW learning rate (peak, after any warm-up).
    lr: float = 5e-4
    #: AdamW decoupled weight decay.
    weight_decay: float = 0.0
    #: AdamW first-moment decay.
    beta1: float = 0.9
    #: AdamW second-moment decay.
    beta2: float = 0.99
    #: AdamW epsilon.
    eps: float = 1e-8
    #: Linear LR warm-up over this many optimizer steps, or over warmup_ratio of them (one
    #: of the two; optimizer steps = train.steps x ppo_epochs x mini_batches).
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    #: "constant" or "cosine" (after warm-up, down to min_lr_ratio * lr).
    schedule: str = "constant"
    min_lr_ratio: float = 0.1
    #: Gradient-norm clipping (None: off).
    grad_clip: float | None = 1.0
    #: AdamW implementation: "auto" (fused on CUDA, foreach elsewhere: one kernel, or one
    #: op per tensor list, instead of a loop over parameters; same results within fp32
    #: rounding), or "fused", "foreach", "single" (torch's per-parameter loop) to force one.
    implementation: str = "auto"

    def validate(self):
        _number(self, "optim", "lr", low=0.0)
        _number(self, "optim", "weight_decay", low=0.0, strict=False)
        _number(self, "optim", "eps", low=0.0)
        _check(0 <= self.beta1 < 1, "optim.beta1", "must be in [0, 1)", self.beta1)
        _check(0 <= self.beta2 < 1, "optim.beta2", "must be in [0, 1)", self.beta2)
        _positive_int(self, "optim", "warmup_steps", allow_zero=True)
        _check(0 <= self.warmup_ratio < 1, "optim.warmup_ratio", "must be in [0, 1)", self.warmup_ratio)
        _check(not (self.warmup_steps and self.warmup_ratio), "optim.warmup_steps / optim.warmup_ratio",
               "are exclusive: set one of them", (self.warmup_steps, self.warmup_ratio))
        _check(self.schedule in ("constant", "cosine"), "optim.schedule", "must be 'constant' or 'cosine'", self.schedule)
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio)
        _number(self, "optim", "grad_clip", low=0.0, allow_none=True)
        _check(self.implementation in ("auto", "fused", "foreach", "single"), "optim.implementation",
               "must be auto, fused, foreach or single", self.implementation)
