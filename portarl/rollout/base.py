"""The rollout-engine interface: prompts in, G sampled completions and their log-probs out.

Seeds: every sample gets its own seed, derived from (run seed, step, prompt index, sample
index) by :func:`sample_seed`. One constant seed per request makes all G samples of a
prompt identical (zero reward spread, zero loss): ``seed_mode="constant"`` exists only to
reproduce that failure, and the identical-groups metric catches it.

Rollout log-probs are those of the temperature-scaled full distribution, log softmax(z/T),
computed with :func:`portarl.ops.logprobs` exactly as the trainer computes its own (top-k /
top-p only restrict which tokens can be drawn).
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    greedy: bool = False

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass
class RolloutBatch:
    """One row per sample: ``prompt_ids`` and ``completion_ids`` (eos included when
    generated, no padding), ``logprobs`` (one per completion token), ``finished``.

    Multi-turn episodes (:mod:`portarl.multiturn`): ``completion_ids`` is everything
    after the prompt, the model's turns and what was appended between them; ``model_mask``
    marks the tokens the model produced (the loss covers these only; ``logprobs`` holds 0.0
    elsewhere) and ``episodes`` each episode's record (conversation, turns, finish reason).
    Both None for single-turn rollouts: every completion token is the model's."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]
    model_mask: list[list[bool]] | None = None
    episodes: list[dict] | None = None
    #: A mixture-of-experts model with routing replay (``rollout.routing_replay: rollout``):
    #: per sample, the experts its tokens were routed to, [MoE layers, fed tokens, k] int16
    #: (the prompt, then the completion but its last token, which the engine never fed).
    routed_experts: list | None = None


def seed_of(key: str) -> int:
    """A 63-bit seed hashed from ``key`` (distinct keys: distinct seeds, up to a 2^-63 collision)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_seed(run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed unique to one sample of one prompt at one step of one run."""
    return seed_of(f"{run_seed}/{step}/{prompt_index}/{sample_index}")


def request_seeds(run_seed: int, step: int, num_prompts: int, group_size: int, mode: str = "per_sample") -> list[int]:
    if mode == "per_sample":
        return [sample_seed(run_seed, step, p, s) for p in range(num_prompts) for s in range(group_size)]
    if mode == "constant":
        return [run_seed] * (num_prompts * group_size)
    raise ValueError(f"rollout.seed_mode={mode!r} must be 'per_sample' or 'constant'")


class RolloutEngine(abc.ABC):
    name: str

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams) -> RolloutBatch:
        """Sample one completion per entry of ``prompts`` (repeat a prompt G times for a group).

        A vision-language model's prompts come with ``media=`` (a
        :class:`portarl.vision.inputs.VisionBatch`, one entry per prompt): an engine that
        takes it adds the keyword (the hf engine, the replay wrappers); the trainer refuses
        the others at start (:func:`portarl.vision.models.vision_refusal`)."""

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (a no-op when it shares them)."""

    def samples_policy_of(self, model: torch.nn.Module) -> bool:
        """Whether the completions of the last :meth:`generate` came from ``model``'s current
        weights (no optimizer step since). The trainer then takes its old log-probs from
        the training forward instead of a separate no-grad forward
        (:func:`portarl.trainer.phases.scoring.old_logprobs_recompute_reason`). Default False: an
        engine that cannot vouch for it (a replayed file, a remote server) keeps the forward."""
        return False

    # Lifecycle hooks the trainer calls; no-ops for engines that share the trainer's model.
    def mark_trainer_updated(self) -> None:
        """The trainer took an optimizer step: the engine's weights are stale until the next
        :meth:`sync_weights` (an engine with its own copy refuses to generate until then)."""

    def sleep(self) -> None:
        """The trainer is about to compute: release what the engine can (KV cache) until
        the next :meth:`sync_weights` or :meth:`generate`."""

    def close(self) -> None:
        """Release the engine for good (processes, device memory, process-wide state)."""


def identical_group_fraction(completions: list[list[int]], group_size: int) -> float:
    """Fraction of groups whose completions are all identical (seeding gone wrong, or collapse)."""
    if group_size < 2 or not completions:
        return 0.0
    groups = [completions[i : i + group_size] for i in range(0, len(completions), group_size)]
    return sum(all(c == g[0] for c in g) for g in groups) / len(groups)
