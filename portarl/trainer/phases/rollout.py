"""Rollout phase of one GRPO iteration: this step's prompts (seeded by run seed and step),
one seed per sample, generation by the rollout engine, and the rollout's own metrics and
events (identical groups, degenerate completions, lengths).

Each rank rolls out whole groups: its slice of the step's prompts starts at
:attr:`RolloutPhase.offset` (prompt index), which scoring uses to take its advantages.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from portarl.assets.data import Example
from portarl.rollout import identical_group_fraction, request_seeds
from portarl.multiturn.trajectory import model_only
from portarl.trainer.phases.episodes import play
from portarl.trainer.phases.prompts import prompts_for_step


@dataclasses.dataclass
class RolloutPhase:
    examples: list[Example]      # this rank's prompts (each sampled group_size times)
    rollout: object              # the engine's RolloutBatch
    texts: list[str]             # decoded completions
    metrics: dict
    events: list                 # (kind, message, fields)
    #: Rewards already computed (and shaped) by the rollout (dynamic sampling), else None:
    #: scoring computes them.
    rewards: torch.Tensor | None = None
    scores: object = None        # RewardScores when the rollout side scored the batch (async mode)
    #: Each reward function's values per sample, with ``rewards`` (dynamic sampling).
    reward_values: dict | None = None
    #: The index of this rank's first prompt in the step's prompts (its slice of the groups).
    offset: int = 0


def run_rollout(trainer, step: int) -> RolloutPhase:
    if trainer.async_rollout is not None:  # rollout.mode=async: a scored batch from the worker process
        return async_phase(trainer, step)
    cfg = trainer.config
    g = cfg.rollout.group_size
    if cfg.rollout.dynamic_sampling:  # DAPO: rounds until prompts_per_step informative groups
        from portarl.trainer.phases.dynamic_sampling import collect

        examples, seeds, rollout, texts, rewards, per_function, ds_metrics, ds_events = collect(trainer, step)
        metrics, events = rollout_metrics(trainer, step, rollout, seeds)
        metrics.update(ds_metrics)
        return RolloutPhase(examples, rollout, texts, metrics, ds_events + events, rewards=rewards,
                            reward_values=per_function, offset=0)
    everyone = prompts_for_step(trainer, step)
    seeds = request_seeds(cfg.train.seed, step, len(everyone), g, cfg.rollout.seed_mode)
    sp = getattr(trainer, "sp", None)  # sequence parallelism: the prompts split per group of ranks, not per rank
    groups, group = (sp.dp_size, sp.dp_rank) if sp is not None else (trainer.dist.world_size, trainer.dist.rank)
    per_rank = len(everyone) // groups
    offset = group * per_rank
    examples = everyone[offset : offset + per_rank]  # whole groups per rank (per sequence-parallel group)
    seeds = seeds[offset * g : (offset + per_rank) * g]
    prompts = [trainer.encoded_prompt(ex) for ex in examples for _ in range(g)]  # encoded when the data loaded
    started, cpu_started = time.perf_counter(), time.process_time()
    trainer.rollout.sync_weights(trainer.model)
    episode_metrics, episode_events = {}, []
    if getattr(trainer, "agent", None) is not None:  # tools / environment: multi-turn episodes (trainer/phases/episodes.py)
        rollout, texts, episode_metrics, episode_events = play(trainer.agent, trainer.rollout, trainer.sampling,
                                                               examples, prompts, seeds, g, trainer.dist)
    else:
        # a vision-language model: each prompt's pixels and positions
        rollout = trainer.rollout.generate(prompts, seeds, trainer.sampling, **trainer.media_for(examples, g))
        texts = [trainer.codec.decode(c) for c in rollout.completion_ids]
    if sp is not None:  # the same rows on every rank of the group, bit for bit: its first rank's
        rollout, texts = same_rows(trainer, sp, rollout)
    trainer.rollout.sleep()  # the trainer computes now: the engine frees what it can (vLLM: KV cache)
    metrics, events = rollout_metrics(trainer, step, rollout, seeds)
    metrics.update(episode_metrics)
    events += episode_events
    metrics["time/rollout_s"] = time.perf_counter() - started  # what async mode overlaps (bench async)
    metrics["time/rollout_cpu_s"] = time.process_time() - cpu_started
    return RolloutPhase(examples, rollout, texts, metrics, events, offset=offset)


def same_rows(trainer, sp, rollout):
    """``(rollout, texts)``: the sequence-parallel group's first rank's completions, log-probs
    and finish flags on every rank of the group. The group's ranks sampled the same prompts
    with the same seeds and weights, so these normally are their own already; sent anyway,
    since the group's shards must cut the very same rows (one differing token, e.g. from a
    kernel's other rounding, would otherwise mix two sequences in one attention)."""
    from portarl.runtime.sequence_parallel import broadcast_rows

    got = broadcast_rows(sp, [rollout.completion_ids, rollout.logprobs, rollout.finished])
    rollout = dataclasses.replace(rollout, completion_ids=got[0], logprobs=got[1], finished=got[2])
    return rollout, [trainer.codec.decode(c) for c in rollout.completion_ids]


def async_phase(trainer, step: int) -> RolloutPhase:
    got = trainer.async_rollout.batch(step)  # this rank's whole groups of the step's batch
    metrics, events = rollout_metrics(trainer, step, got.rollout, got.seeds)
    metrics.update(got.metrics)
    return RolloutPhase(got.examples, got.rollout, got.texts, metrics, got.events + events, scores=got.scores,
                        offset=got.offset)


def identical_cause(seeds: list[int], completions: list[list[int]], logprobs: list[list[float]], g: int,
                    min_chance: float) -> tuple[str, str]:
    """Why groups have all-identical completions.

    ``("seeding", why)`` when seeds repeat inside a group, or completions repeat across
    prompts' groups under seeds that repeat across groups. Otherwise each identical group is
    judged by the sampled log-prob of its completion, ``lp`` (the sum over its tokens, under
    the sampling distribution): with distinct seeds, G draws repeat it by chance
    ``exp((G - 1) * lp)``. A task with a tiny answer space ("1+2=" -> "3") has completions
    of probability near 1, so identical groups are expected there: ``("confident", why)``.
    A group whose completion was unlikely (chance below ``min_chance``) but repeated
    anyway points at a sampler that ignores its seeds: ``("sampler", why)``.
    """
    groups = [seeds[i : i + g] for i in range(0, len(seeds), g)]
    if any(len(set(grp)) < len(grp) for grp in groups):
        return "seeding", "seeds repeat inside a group (one seed per request gives identical samples)"
    across = len({tuple(c) for c in completions}) == 1 and len(groups) > 1
    if across and len(set(seeds)) < len(seeds):
        return "seeding", "every prompt's group produced the same completion, and seeds repeat across groups"
    identical = [i for i in range(0, len(completions), g) if len({tuple(c) for c in completions[i : i + g]}) == 1]
    if not identical:
        return "confident", "no group is all-identical"
    lps = [float(sum(logprobs[i])) for i in identical]
    chances = [math.exp((g - 1) * lp) for lp in lps]
    unlikely = [c for c in chances if c < min_chance]
    if unlikely:
        worst = min(range(len(lps)), key=lambda k: lps[k])
        return "sampler", (f"{len(unlikely)} of {len(identical)} identical groups repeat a completion too unlikely to "
                           f"repeat by chance with distinct seeds (the least likely: sampled log-prob {lps[worst]:.3g}, "
                           f"{g} identical draws a {chances[worst]:.1e} chance < rollout.identical_min_chance "
                           f"{min_chance:g}): check the engine's sampling settings and how it uses seeds")
    return "confident", (f"every identical group's completion is likely enough to repeat ({g} identical draws a chance "
                         f">= {min(chances):.2g}): a confident policy on a small answer space, seeds distinct")


def rollout_metrics(trainer, step: int, rollout, seeds: list[int]) -> tuple[dict, list]:
    cfg = trainer.config
    g = cfg.rollout.group_size
    metrics: dict = {"step": step, "phase": "grpo"}
    identical = identical_group_fraction(rollout.completion_ids, g)
    # Multi-turn: the model's own tokens (tool and environment tokens are context, with no log-prob)
    mask = getattr(rollout, "model_mask", None)
    degenerate_frac, degenerate_event = trainer.degenerate.update(model_only(rollout.completion_ids, mask))
    lengths = [len(c) for c in rollout.completion_ids]
    tokens = [-lp for row in model_only(rollout.logprobs, mask) for lp in row]
    metrics.update({
        "rollout/identical_group_frac": identical, "rollout/degenerate_frac": degenerate_frac,
        "rollout/sample_neg_logp": sum(tokens) / len(tokens) if tokens else 0.0,
        "completion/len_mean": sum(lengths) / len(lengths),
        "completion/finished_frac": sum(rollout.finished) / len(rollout.finished),
    })
    events = []
    if identical > cfg.rollout.identical_warn_frac:
        cause, why = identical_cause(seeds, rollout.completion_ids, rollout.logprobs, g, cfg.rollout.identical_min_chance)
    else:
        cause = "confident"
    if cause != "confident":  # a confident policy repeating likely answers is no event (the fraction is logged)
        events.append(("identical_samples", f"{identical:.0%} of groups have all-identical completions "
                       f"(> rollout.identical_warn_frac {cfg.rollout.identical_warn_frac:g}); likely cause: {cause}: "
                       f"{why}", {"cause": cause, "value": identical}))
    if degenerate_event:
        events.append(("degenerate_rise", f"degenerate completions (one token repeated) jumped to {degenerate_frac:.0%} "
                       f"from a median of {degenerate_event['median']:.0%}", degenerate_event))
    return metrics, events
