"""The trainer's side of multi-turn rollouts (``tools`` / ``environment`` in the config):
the episodes of a step played with the trainer's engine, the rows the rewards see, and
the model-token mask the loss uses. The episodes themselves are
:mod:`portarl.multiturn`; this module is the few places the trainer calls it.
"""

from __future__ import annotations

import torch

from portarl.runtime import distributed as pdist
from portarl.assets.data import Example
from portarl.multiturn.episode import EpisodeRunner
from portarl.runtime.user_code import agree_on_failure


def lock_step(dist):
    """``agree(n, failure)``: the largest running-episode count over ranks (each turn's
    rows), so every rank runs the same generate calls (FSDP forwards are collective, and so
    is a vllm engine that ``rollout.tensor_parallel_size`` ranks share:
    :mod:`portarl.rollout.vllm_tp`). A rank's ``failure`` (a stop signal that ended a tool
    or environment call) is raised on every rank, the first failing rank's message on the
    others (:func:`~portarl.runtime.user_code.agree_on_failure`), in the same one reduction."""
    if not dist.enabled:
        return None

    def agree(n: int, failure=None) -> int:
        got = pdist.all_reduce(dist, torch.tensor([float(n), float(failure is not None)]),
                               op=torch.distributed.ReduceOp.MAX)
        if got[1]:
            raise agree_on_failure(dist, failure)
        return int(got[0])

    return agree


def summed(dist):
    """``total(counts)``: a list of counts summed over ranks (None in one process)."""
    if dist is None or not dist.enabled:
        return None

    def total(counts: list) -> list:
        return pdist.all_reduce(dist, torch.tensor(counts, dtype=torch.float64)).tolist()

    return total


def play(agent, engine, sampling, examples: list[Example], prompts, seeds, group_size: int, dist=None,
         training: bool = True):
    """The episodes of ``examples`` (each ``group_size`` times, prompts and seeds per sample):
    ``(rollout, texts, metrics, events)``; ``texts`` are the final model turns (what
    per-sample rewards read). ``training``: an environment that fails every one of its
    episodes of the step stops the run (evaluation only counts it)."""
    runner = EpisodeRunner(agent, engine, sampling, agree=lock_step(dist) if dist is not None else None,
                           total=summed(dist), stop_on_broken_env=training)
    per_sample = [ex for ex in examples for _ in range(group_size)]
    rollout, metrics, events = runner.run(per_sample, prompts, seeds)
    return rollout, [ep["final"] for ep in rollout.episodes], metrics, events


def episode_columns(with_environment: bool) -> list[str]:
    """The columns :func:`reward_examples` adds to each data row (what a batched reward of
    a multi-turn run must accept besides the data's own)."""
    return ["conversation"] + (["env_reward"] if with_environment else [])


def reward_examples(examples: list[Example], group_size: int, rollout, with_environment: bool) -> list[Example]:
    """One row per sample for the rewards: its data row plus the columns ``conversation``
    (the messages after the prompt: role, content, and the parsed ``tool_calls`` of a model
    turn that made some; last, what came after the model's last turn and it never read, such
    as the environment's final observation) and, with an environment, ``env_reward`` (the episode's
    environment reward, :mod:`portarl.multiturn.environment`; 0.0 when the environment
    failed), which the built-in reward ``environment`` returns."""
    out = []
    for i, record in enumerate(rollout.episodes):
        ex = examples[i // group_size]
        columns = {**ex.columns, "conversation": [{k: m[k] for k in ("role", "content", "tool_calls") if k in m}
                                                  for m in record["messages"] + record["unread"]]}
        if with_environment:
            columns["env_reward"] = record["env_reward"] if record["env_reward"] is not None else 0.0
        out.append(Example(ex.prompt, ex.answer, columns, ex.where))
    return out


__all__ = ["episode_columns", "lock_step", "play", "reward_examples", "summed"]
