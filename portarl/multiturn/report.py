"""What a batch of episodes reports: the ``agent/*`` metrics, one event when user code
failed (a tool or environment that raised, hung, returned something that is not JSON or
killed its process), and each episode's record for the sample log (its conversation, turn
by turn, with the tokens each message took, and who wrote each run of its token ids).

Metrics (per step; means over episodes, so one process and several ranks, whose metrics
are averaged, read alike, except ``agent/tool_success_frac``, ``agent/env_reward_mean`` and
the maxima: under torchrun, the mean of each rank's):

- ``agent/turns_mean``, ``agent/turns_max``: model turns per episode;
- ``agent/tokens_per_turn``: model tokens per turn; ``agent/model_token_frac``: the share
  of the tokens after the prompt that the model produced (the rest is context: not trained on);
- ``agent/tool_calls``: calls parsed per episode; ``agent/tool_success_frac``: the share of
  calls that returned a result; ``agent/tool_used_frac``: episodes with at least one;
- ``agent/tool_errors``: calls answered with an error, per episode (the tool raised, hung or
  returned something that is not JSON, or the model named an unknown tool or wrong
  arguments); ``agent/tool_timeouts``: of them, past ``rollout.tool_timeout_s``;
  ``agent/malformed_calls``: calls that did not parse, per episode;
- ``agent/tool_time_s``: seconds in tool calls and environment steps per episode;
  ``agent/tool_time_max_s``: the longest single call;
- ``agent/env_steps``: environment steps per episode; ``agent/env_errors``: the share of
  episodes whose environment failed (a ``reset``, ``step``, ``get_reward`` or ``close`` that
  raised, hung, answered something malformed or lost its process). The first failure ends
  the episode with finish ``env_error`` and env reward 0.0, so an episode fails at most once
  and ``agent/env_errors`` equals ``agent/finish_env_error_frac``; the ``tool_errors`` event
  counts the same episodes ("the environment failed in E of N episodes");
  ``agent/env_reward_mean`` (over the episodes whose environment did not fail);
- ``agent/truncated_observations``: tool results and environment observations (reset text
  included) cut at ``rollout.max_tool_tokens``, per episode (:mod:`.observations`);
- ``agent/finish_<reason>_frac`` for each way an episode ends (:mod:`.episode`);
- ``agent/tool_process_restarts`` (process isolation: tool processes killed by a hung call
  or ended by a crash, since the run started).
"""

from __future__ import annotations

import dataclasses

from portarl.multiturn.environment import setting_of
from portarl.runtime.user_code import UserCodeError

REASONS = ("stop", "done", "max_turns", "length", "budget", "env_error")


@dataclasses.dataclass
class Counts:
    calls: int = 0
    succeeded: int = 0
    errors: int = 0
    timeouts: int = 0
    malformed: int = 0
    code_failures: int = 0          # tool calls that raised / hung / returned non-JSON / lost their process
    env_steps: int = 0
    env_errors: int = 0             # 0 or 1: the environment's first failure ends the episode
    truncated: int = 0              # observations cut at rollout.max_tool_tokens
    tool_time: list = dataclasses.field(default_factory=list)
    first_error: str | None = None  # the first failure of a tool's or environment's code, for the event


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def episode_metrics(episodes, executor) -> dict:
    counts = [ep.counts for ep in episodes]
    calls = sum(c.calls for c in counts)
    times = [t for c in counts for t in c.tool_time]
    rewards = [ep.env_reward for ep in episodes if ep.env_reward is not None]
    n = max(1, len(episodes))
    metrics = {
        "agent/turns_mean": _mean(ep.turns for ep in episodes),
        "agent/turns_max": float(max((ep.turns for ep in episodes), default=0)),
        "agent/tokens_per_turn": _mean(ep.traj.model_tokens / max(1, ep.turns) for ep in episodes),
        "agent/model_token_frac": _mean(ep.traj.model_tokens / max(1, len(ep.traj.ids)) for ep in episodes),
        "agent/tool_calls": calls / n,
        "agent/tool_success_frac": sum(c.succeeded for c in counts) / calls if calls else 0.0,
        "agent/tool_used_frac": sum(c.succeeded > 0 for c in counts) / n,
        "agent/tool_errors": sum(c.errors for c in counts) / n,
        "agent/tool_timeouts": sum(c.timeouts for c in counts) / n,
        "agent/malformed_calls": sum(c.malformed for c in counts) / n,
        "agent/tool_time_s": sum(times) / n,
        "agent/tool_time_max_s": max(times, default=0.0),
        "agent/env_steps": sum(c.env_steps for c in counts) / n,
        "agent/env_errors": sum(c.env_errors for c in counts) / n,
        "agent/truncated_observations": sum(c.truncated for c in counts) / n,
    }
    if rewards:
        metrics["agent/env_reward_mean"] = _mean(rewards)
    for reason in REASONS:
        metrics[f"agent/finish_{reason}_frac"] = sum(ep.finish == reason for ep in episodes) / n
    restarts = getattr(executor, "restarts", None)
    if restarts is not None:
        metrics["agent/tool_process_restarts"] = float(restarts)
    return metrics


def errors_event(episodes) -> tuple | None:
    """``("tool_errors", message, fields)`` when a tool's or an environment's code failed in
    this batch: tool calls that failed (``value``; ``timeouts`` of them past
    ``rollout.tool_timeout_s``) and episodes whose environment failed (``env_errors``, of
    ``episodes``: the episodes ``agent/env_errors`` and ``agent/finish_env_error_frac`` count)."""
    counts = [ep.counts for ep in episodes]
    failures = sum(c.code_failures for c in counts)
    env_errors = sum(c.env_errors for c in counts)
    if not failures and not env_errors:
        return None
    first = next((c.first_error for c in counts if c.first_error), "?")
    timeouts = sum(c.timeouts for c in counts)
    parts = []
    if failures:
        parts.append(f"{failures} tool call(s) failed ({timeouts} past rollout.tool_timeout_s)")
    if env_errors:
        parts.append(f"the environment failed in {env_errors} of {len(episodes)} episode(s)")
    effects = (["each failed tool call became an error message in its conversation"] if failures else []) + (
        ["each failed environment ended its episode (the error is under 'unread' in the sample log)"] if env_errors else [])
    message = f"{' and '.join(parts)} in this batch; {'; '.join(effects)}; the run goes on. First: {first}"
    return ("tool_errors", message, {"value": failures, "timeouts": timeouts, "env_errors": env_errors,
                                     "episodes": len(episodes)})


def broken_environment(episodes, factories: dict, total=None) -> UserCodeError | None:
    """The first environment (in the config's order) whose every episode of this batch
    failed, as the failure that stops the run (exit 3), or None. ``factories``: the agent's
    ``{name: factory}``; ``total``: sums a list of counts over ranks under torchrun (every
    rank calls it, with the same list length), so that "every episode" means the step's."""
    names = list(factories)
    counts = []
    for name in names:
        mine = [ep for ep in episodes if ep.env_name == name]
        counts += [len(mine), sum(ep.finish == "env_error" for ep in mine)]
    if total is not None:
        counts = total(counts)
    for k, name in enumerate(names):
        played, failed = int(counts[2 * k]), int(counts[2 * k + 1])
        if not played or failed < played:
            continue
        factory = factories[name]
        spec = f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', factory)}"
        first = next((ep.env_error for ep in episodes if ep.env_name == name and ep.env_error), None)
        return UserCodeError(f"{setting_of(name)} {spec!r}", None,
                             f"failed in all {played} of its episodes of this step"
                             + (f" (the first: {first})" if first else "")
                             + "; an environment that fails every episode trains on nothing: fix it and --resume")
    return None


def episode_record(ep) -> dict:
    """An episode for the sample log: the messages after the prompt that the model read, the
    ones produced after its last turn that it never read (``unread``: a final observation, an
    environment's error, results past the token budget), who wrote each run of its ids
    (``segments``, :class:`~portarl.multiturn.trajectory.Trajectory`) and how it ended."""
    return {"turns": ep.turns, "finish": ep.finish, "messages": ep.messages, "unread": ep.unread,
            "segments": ep.traj.segments, "env_reward": ep.env_reward,
            "tool_calls": ep.counts.calls, "tool_errors": ep.counts.errors, "malformed_calls": ep.counts.malformed,
            "truncated_observations": ep.counts.truncated,
            "final": ep.final_text}


__all__ = ["Counts", "REASONS", "broken_environment", "episode_metrics", "episode_record", "errors_event"]
