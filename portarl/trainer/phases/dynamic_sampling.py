"""DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476, sec. 3.2; verl's
``algorithm.filter_groups``): generate rounds of ``train.prompts_per_step`` fresh prompts
until the batch holds ``prompts_per_step`` groups whose rewards are not all equal, at most
``rollout.max_generation_rounds`` rounds.

A group whose G rewards are all equal has zero advantage under group normalisation: it
gives no gradient and only dilutes the token normaliser. Here such groups are set aside;
the step trains on exactly ``prompts_per_step`` informative groups (the first ones found,
in generation order). When the cap is hit first, the batch is filled with set-aside groups,
which scoring masks out (``drop_zero_std`` is forced on), and a ``dynamic_sampling_cap``
event says so.

Round 0 is the ordinary rollout: the step's prompts (:func:`prompts_for_step`) and seeds
(:func:`~portarl.rollout.request_seeds`), so a run whose first round is informative
everywhere is bitwise the run without dynamic sampling. Round r > 0 draws its own prompts
and per-sample seeds from (run seed, step, r): never a repeat of another round's or step's
seed. Rewards (with the overlong penalty, :mod:`portarl.trainer.phases.shaping`) are computed here,
once per round, and handed to scoring with the batch.

Metrics: ``rollout/rounds``, ``rollout/informative_frac`` (informative groups / groups
generated), ``rollout/generated_groups``. Single process only (under torchrun each rank
would keep a different number of groups): refused there with a message.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from portarl.rollout import RolloutBatch, request_seeds
from portarl.rollout.base import seed_of
from portarl.trainer.phases.prompts import prompts_for_step


@dataclasses.dataclass
class _Group:
    example: object
    seeds: list[int]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]
    texts: list[str]
    rewards: torch.Tensor                # [G], shaped
    per_function: dict[str, list]        # name -> G values


def round_seeds(run_seed: int, step: int, round_index: int, num_prompts: int, group_size: int, mode: str) -> list[int]:
    """Per-sample seeds of one generation round: round 0 is :func:`request_seeds`; round
    r > 0 hashes (run seed, step, r, prompt, sample), distinct from every other round's and
    step's. ``mode="constant"`` keeps its one seed (it reproduces the identical-samples failure)."""
    if round_index == 0 or mode == "constant":
        return request_seeds(run_seed, step, num_prompts, group_size, mode)
    return [seed_of(f"{run_seed}/{step}/round{round_index}/{p}/{s}") for p in range(num_prompts)
            for s in range(group_size)]


def round_prompts(trainer, step: int, round_index: int) -> list:
    """Round 0: the step's prompts; round r > 0: a draw seeded by (run seed, step, r)."""
    if round_index == 0:
        return prompts_for_step(trainer, step)
    rng = random.Random(f"{trainer.config.train.seed}/prompts/{step}/round{round_index}")
    n = trainer.config.train.prompts_per_step
    pool = trainer.examples
    return rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]


def informative(rewards: torch.Tensor) -> bool:
    """Not all equal (verl's filter: the group's reward std > 0)."""
    return bool(rewards.numel() > 1 and (rewards.max() > rewards.min()))


def _generate_round(trainer, step: int, round_index: int) -> list[_Group]:
    from portarl.trainer.phases.shaping import shape_rewards

    cfg = trainer.config
    g = cfg.rollout.group_size
    examples = round_prompts(trainer, step, round_index)
    seeds = round_seeds(cfg.train.seed, step, round_index, len(examples), g, cfg.rollout.seed_mode)
    prompts = [trainer.encoded_prompt(ex) for ex in examples for _ in range(g)]
    rollout = trainer.rollout.generate(prompts, seeds, trainer.sampling, **trainer.media_for(examples, g))
    texts = [trainer.codec.decode(c) for c in rollout.completion_ids]
    scores = trainer.score_rewards(examples, texts)
    rewards = shape_rewards(cfg, scores.total, rollout.completion_ids, {})
    per_function = scores.per_function
    groups = []
    for i, ex in enumerate(examples):
        rows = slice(i * g, (i + 1) * g)
        groups.append(_Group(ex, seeds[rows], rollout.prompt_ids[rows], rollout.completion_ids[rows],
                             rollout.logprobs[rows], rollout.finished[rows], texts[rows], rewards[rows],
                             {k: list(v[rows]) for k, v in per_function.items()}))
    return groups


def collect(trainer, step: int):
    """The step's groups: ``(examples, seeds, rollout, texts, rewards, per_function,
    metrics, events)`` with exactly ``prompts_per_step`` groups (see the module docstring)."""
    cfg = trainer.config
    want, cap = cfg.train.prompts_per_step, cfg.rollout.max_generation_rounds
    kept: list[_Group] = []
    spare: list[_Group] = []
    rounds = generated = 0
    trainer.rollout.sync_weights(trainer.model)
    while len(kept) < want and rounds < cap:
        for group in _generate_round(trainer, step, rounds):
            (kept if informative(group.rewards) else spare).append(group)
            generated += 1
        rounds += 1
    trainer.rollout.sleep()  # the trainer computes now: the engine frees what it can (vLLM: KV cache)
    found = len(kept)
    chosen = kept[:want] + spare[: max(0, want - found)]
    metrics = {"rollout/rounds": rounds, "rollout/informative_frac": found / generated,
               "rollout/generated_groups": generated}
    events = []
    if found < want:
        events.append(("dynamic_sampling_cap", (
            f"dynamic sampling: after {rounds} generation round(s) (rollout.max_generation_rounds={cap}) only {found} of "
            f"the {want} groups have rewards that are not all equal; this step trains on those {found} (the other "
            f"{want - found} are masked out). Raise rollout.max_generation_rounds, or check the data and rewards: "
            "prompts that every sample solves (or none does) give no signal"), {"found": found, "rounds": rounds}))
    rollout = RolloutBatch([r for grp in chosen for r in grp.prompt_ids], [c for grp in chosen for c in grp.completion_ids],
                           [lp for grp in chosen for lp in grp.logprobs], [f for grp in chosen for f in grp.finished])
    per_function = {name: [v for grp in chosen for v in grp.per_function[name]] for name in chosen[0].per_function}
    for name, values in per_function.items():  # the reward metrics of the batch trained on
        given = [v for v in values if v is not None]
        if given:
            metrics[f"reward/{name}"] = sum(given) / len(given)
    return ([grp.example for grp in chosen], [s for grp in chosen for s in grp.seeds], rollout,
            [t for grp in chosen for t in grp.texts], torch.cat([grp.rewards for grp in chosen]), per_function,
            metrics, events)
