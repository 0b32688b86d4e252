"""Multi-turn episodes: generate, read the tool calls, run the tools or step the
environment, append what comes back, generate again.

One :meth:`EpisodeRunner.run` plays a batch of episodes in lock step: each turn, every
episode still running is one row of a single ``engine.generate`` call (any engine: ``hf``,
``vllm``, a replay), so the engine batches them as it batches single turns. Turn ``t`` of
the sample with seed ``s`` draws with seed ``s`` at turn 0 (an episode that never calls a
tool samples exactly what a single-turn rollout samples) and ``seed_of("s/turn/t")`` after.

An episode ends (``finish`` reason) at:

- ``stop``: a reply without a tool call (no environment), the model's final answer;
- ``done``: the environment said so;
- ``max_turns``: ``rollout.max_turns`` model turns, the last one still calling a tool or
  answered by the environment;
- ``length``: a turn cut at ``rollout.max_new_tokens`` without an end token;
- ``budget``: ``rollout.max_episode_tokens``, or the next turn would not fit the engine's
  context (the model's ``max_position_embeddings``; vllm's ``vllm_max_model_len``): what a
  turn appends is appended only when the next turn still fits, so an episode never outgrows
  either;
- ``env_error``: the environment (its ``reset``, ``step``, ``get_reward`` or ``close``) raised,
  hung or answered something malformed; its first failure ends the episode, whatever cut
  that turn.

``stop`` and ``done`` count as finished (``RolloutBatch.finished``, what
``shaping.mask_truncated_completions`` and the sample log's finish reason read); the
others as truncated.

Every call into user code goes through the agent's executor with ``rollout.tool_timeout_s``:
an exception, a hang, a result that is not JSON, an unknown tool, arguments that do not fit
its signature, or a call that does not parse becomes an ``Error: ...`` message the model
reads in its next turn and a metric (:mod:`.report`); the run goes on, unless (training:
``stop_on_broken_env``) an environment failed every one of its episodes of the batch: that
stops the run as a failing reward does (:func:`~portarl.multiturn.report.broken_environment`).
Every tool result and environment observation (the reset text too) is first cut at
``rollout.max_tool_tokens`` (:mod:`.observations`, ``agent/truncated_observations``).

Under torchrun every rank's engine forward is collective, so every rank must run the same
generate calls: ``agree(n, failure)`` (the maximum over ranks) sets each turn's row count and
a rank with fewer running episodes pads its batch with copies of a prompt whose samples it
drops. The one failure a call into a tool or an environment lets through, a stop signal
that ended it (``UserCodeError`` of kind ``interrupted``), waits for the next agreement, so
that every rank leaves the loop together (``agree`` raises on every rank when one failed:
the others would otherwise wait for the failed rank at their next collective), and a last
agreement after the environments' ends lets no rank leave with a failure its peers missed.
"""

from __future__ import annotations

import dataclasses
import json

from portarl.rollout.base import RolloutBatch, seed_of
from portarl.runtime.user_code import UserCodeError
from portarl.multiturn.environment import environment_of
from portarl.multiturn.render import tool_result_messages
from portarl.multiturn.report import Counts, broken_environment, episode_metrics, episode_record, errors_event
from portarl.multiturn.trajectory import Trajectory

FINISHED = ("stop", "done")


def turn_seed(seed: int, turn: int) -> int:
    return seed if turn == 0 else seed_of(f"{seed}/turn/{turn}")


def alone(n: int, failure: UserCodeError | None) -> int:
    """``agree`` of one process: nothing to wait for, a failure raised at once."""
    if failure is not None:
        raise failure
    return n


def context_limit(engine) -> int | None:
    """Positions the engine can hold (prompt and completion): vllm's max_model_len, the HF
    model's max_position_embeddings; None when it does not say."""
    limit = getattr(engine, "max_model_len", None)
    if limit is None:
        limit = getattr(getattr(getattr(engine, "model", None), "config", None), "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) else None


@dataclasses.dataclass
class Episode:
    seed: int
    row: dict
    traj: Trajectory
    env_name: str | None = None
    env_key: str | None = None      # set while its environment lives
    env_failed: str | None = None   # reset failed: one turn, then the episode ends
    env_error: str | None = None    # its environment's failure (one line), which ended it
    messages: list = dataclasses.field(default_factory=list)  # what the model read, in order
    unread: list = dataclasses.field(default_factory=list)    # produced after its last turn, never appended
    turns: int = 0
    finish: str | None = None
    final_text: str = ""
    env_rewards: list = dataclasses.field(default_factory=list)
    env_reward: float | None = None
    counts: Counts = dataclasses.field(default_factory=Counts)


class EpisodeRunner:
    """Plays episodes with ``engine`` for ``agent`` (see the module docstring)."""

    def __init__(self, agent, engine, params, *, agree=None, total=None, stop_on_broken_env: bool = False):
        """``stop_on_broken_env`` (training): an environment that failed every one of its
        episodes of the batch stops the run (:func:`~portarl.multiturn.report.broken_environment`;
        ``total``: the sum over ranks under torchrun, with ``agree``)."""
        self.agent, self.engine, self.params = agent, engine, params
        self.codec = agent.codec
        self.agree = agree or alone
        self.total, self.stop_on_broken_env = total, stop_on_broken_env
        self.deferred = agree is not None  # a failure waits for the next agreement (torchrun)
        self.limit = context_limit(engine)
        self._next_key = 0

    # ----------------------------------------------------------------- the loop
    def run(self, examples, prompt_ids: list[list[int]], seeds: list[int]) -> tuple[RolloutBatch, dict, list]:
        """One episode per entry (``examples[i]``: its data row, ``prompt_ids[i]`` its
        encoded prompt). Returns the batch (with ``model_mask`` and ``episodes``), the
        ``agent/*`` metrics and the events."""
        episodes, failure = [], None
        try:
            for ex, ids, seed in zip(examples, prompt_ids, seeds):
                episodes.append(self._start(ex, ids, seed))
        except UserCodeError as err:
            failure = self._defer(err)
        for ep, ex in zip(episodes, examples):
            if self.limit is not None and len(ep.traj.prompt_ids) + self.params.max_new_tokens > self.limit:
                raise ValueError(f"{ex.where or 'a data row'}: the prompt is {len(ep.traj.prompt_ids)} tokens (with "
                                 "the tools' description and the environment's reset text); with rollout.max_new_tokens="
                                 f"{self.params.max_new_tokens} it does not fit the engine's {self.limit} positions "
                                 "(raise rollout.vllm_max_model_len with vllm, or shorten the prompt)")
        for turn in range(self.agent.max_turns):
            for ep in episodes:
                if ep.finish is None and ep.turns and not self._next_turn_fits(ep, 0):
                    ep.finish = "budget"
            running = [ep for ep in episodes if ep.finish is None]
            rows = self.agree(len(running), failure)  # raises on every rank when one failed
            if rows == 0:
                break
            contexts = [ep.traj.context() for ep in running]
            turn_seeds = [turn_seed(ep.seed, turn) for ep in running]
            spare = rows - len(running)  # torchrun: rows only this rank lacks, sampled and dropped
            out = self.engine.generate(contexts + [episodes[0].traj.prompt_ids] * spare, turn_seeds + [0] * spare,
                                       self.params)
            try:
                for i, ep in enumerate(running):
                    self._after_turn(ep, out.completion_ids[i], out.logprobs[i], out.finished[i],
                                     last=turn + 1 == self.agent.max_turns)
            except UserCodeError as err:
                failure = self._defer(err)
        try:
            for ep in episodes if failure is None else ():  # after a failure: the run stops (agent.close ends them)
                ep.finish = ep.finish or "max_turns"
                self._end_environment(ep)
        except UserCodeError as err:
            failure = self._defer(err)
        if self.stop_on_broken_env and self.agent.factories:  # on every rank: total() is collective
            broken = broken_environment(episodes, self.agent.factories, self.total)
            if broken is not None:
                failure = failure or self._defer(broken)
        self.agree(0, failure)  # no rank leaves with a failure its peers did not see
        batch = RolloutBatch([ep.traj.prompt_ids for ep in episodes], [ep.traj.ids for ep in episodes],
                             [ep.traj.logprobs for ep in episodes], [ep.finish in FINISHED for ep in episodes],
                             model_mask=[ep.traj.model_mask for ep in episodes],
                             episodes=[episode_record(ep) for ep in episodes])
        metrics = episode_metrics(episodes, self.agent.executor)
        event = errors_event(episodes)
        return batch, metrics, [event] if event else []

    def _defer(self, err: UserCodeError) -> UserCodeError:
        """``err`` kept for the next agreement under torchrun; raised at once otherwise."""
        if not self.deferred:
            raise err
        return err

    def _start(self, example, prompt_ids, seed) -> Episode:
        row = {**example.columns, "prompt": example.prompt}
        ep = Episode(seed, row, Trajectory(list(prompt_ids)))
        if not self.agent.factories:
            return ep
        ep.env_name = environment_of(row, self.agent.factories)
        key = f"episode-{self._next_key}"
        self._next_key += 1
        got = self.agent.executor.run("env_reset", key, ep.env_name, row)
        if not got.ok:
            self.agent.executor.forget(key)
            ep.env_failed = f"Error: the environment's reset {got.error}"
            self._count_environment_failure(ep, f"reset {got.error}")
            return ep
        ep.env_key = key
        if got.value:  # appended to the last user message, as TRL's environment_factory does
            text = self._bounded(ep, got.value, in_room=False)  # too long for the context: refused below
            ep.traj.prompt_ids = self.codec.encode_prompt(_with_observation(example.prompt, text))
        return ep

    def _after_turn(self, ep: Episode, ids, logprobs, ended: bool, last: bool) -> None:
        ids, logprobs = list(ids), list(logprobs)
        budget = self.agent.max_episode_tokens
        cut = budget is not None and len(ep.traj.ids) + len(ids) > budget
        if cut:
            keep = max(0, budget - len(ep.traj.ids))
            ids, logprobs = ids[:keep], logprobs[:keep]
        ep.traj.add_model(ids, logprobs)
        ep.turns += 1
        ep.final_text = self.codec.decode(ids)
        ep.messages.append({"role": "assistant", "content": ep.final_text, "tokens": len(ids)})
        if ep.env_failed:  # its reset failed: whatever cut the turn, the environment ended the episode
            ep.unread.append({"role": "user", "content": ep.env_failed})
            ep.finish = "env_error"
        elif cut or not ids:
            ep.finish = "budget"
        elif not ended:
            ep.finish = "length"
        if ep.finish:
            return
        parsed = self.agent.parse(self._raw_text(ids)) if self.agent.tools else None
        if parsed is not None and parsed.wants_tools:
            ep.messages[-1]["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in parsed.calls]
            if last:
                ep.finish = "max_turns"
                return
            messages, role = tool_result_messages(self._run_calls(ep, parsed), self.agent.template_tools), "tool"
        elif ep.env_key is not None:
            messages, role = self._step_environment(ep, last), "environment"
        else:
            ep.finish = "stop"
        if ep.finish is None:
            self._append(ep, messages, ids[-1], role)

    # -------------------------------------------------------------- tool calls
    def _run_calls(self, ep: Episode, parsed) -> list[tuple[str, str]]:
        results = []
        for why in parsed.malformed:
            ep.counts.malformed += 1
            results.append(("error", f"Error: malformed tool call: {why}"))
        for call in parsed.calls:
            ep.counts.calls += 1
            results.append((call.name, self._call(ep, call)))
        return [(name, self._bounded(ep, content)) for name, content in results]

    def _call(self, ep: Episode, call) -> str:
        tool = self.agent.tools.get(call.name)
        if tool is None:
            problem = f"unknown tool {call.name!r} (tools: {', '.join(self.agent.tools)})"
        elif (why := tool.bind_error(call.arguments)) is not None:
            problem = f"bad arguments for tool {call.name!r}: {why}"
        else:
            got = self.agent.executor.run("tool", call.name, call.arguments)
            ep.counts.tool_time.append(got.elapsed_s)
            if got.ok:
                ep.counts.succeeded += 1
                return got.value if isinstance(got.value, str) else json.dumps(got.value, ensure_ascii=False)
            ep.counts.timeouts += got.kind == "timeout"
            ep.counts.code_failures += 1
            problem = f"tool {call.name!r} {got.error}"
            ep.counts.first_error = ep.counts.first_error or problem
        ep.counts.errors += 1
        return f"Error: {problem}"

    # ------------------------------------------------------------- environment
    def _step_environment(self, ep: Episode, last: bool) -> list[dict]:
        got = self.agent.executor.run("env_step", ep.env_key, ep.final_text)
        ep.counts.tool_time.append(got.elapsed_s)
        if not got.ok:
            self._environment_failed(ep, f"step {got.error}")
            return []
        step = got.value
        ep.counts.env_steps += 1
        if step["reward"] is not None:
            ep.env_rewards.append(step["reward"])
        observation = step["observation"]
        message = {"role": step["role"], "content": None if observation is None else self._bounded(ep, observation)}
        if step["done"] or last:
            if observation is not None:  # shown in the sample log as unread: nothing reads it
                ep.unread.append(message)
            ep.finish = "done" if step["done"] else "max_turns"
            return []
        return [message]

    def _environment_failed(self, ep: Episode, problem: str) -> None:
        self.agent.executor.forget(ep.env_key)
        ep.env_key = None
        self._count_environment_failure(ep, problem)
        ep.unread.append({"role": "user", "content": f"Error: the environment's {problem}"})
        ep.finish = "env_error"

    @staticmethod
    def _count_environment_failure(ep: Episode, problem: str) -> None:
        """The one failure of ``ep``'s environment (it ends the episode: :mod:`.report`)."""
        ep.env_error = problem
        ep.counts.env_errors = 1
        ep.counts.first_error = ep.counts.first_error or f"environment: {problem}"

    def _end_environment(self, ep: Episode) -> None:
        if ep.env_key is None:
            return
        got = self.agent.executor.run("env_reward", ep.env_key)
        if not got.ok:
            self._environment_failed(ep, f"get_reward {got.error}")
            return
        closed = self.agent.executor.run("env_close", ep.env_key)
        if not closed.ok:  # as any other call of it: the episode ends with env_error, its env reward 0.0
            self._environment_failed(ep, f"close {closed.error}")
            return
        ep.env_reward = got.value if got.value is not None else float(sum(ep.env_rewards))
        self.agent.executor.forget(ep.env_key)
        ep.env_key = None

    # ---------------------------------------------------------------- helpers
    def _append(self, ep: Episode, messages: list[dict], last_token: int, role: str) -> None:
        """Append ``messages`` (their ids, the next generation prompt included; ``role``:
        ``tool`` or ``environment``); the first message's ``tokens`` counts them all. No room
        left for a next turn after them (the episode budget or the engine's context): the
        episode ends, the messages kept as unread (nothing reads them)."""
        ids = self.agent.renderer.continuation_ids(messages, last_token)
        if self._next_turn_fits(ep, len(ids)):
            ep.messages += [{**m, "tokens": len(ids) if k == 0 else 0} for k, m in enumerate(messages)]
            ep.traj.add_context(ids, role)
        else:
            ep.unread += messages
            ep.finish = "budget"

    # ------------------------------------------------- bounded observations (issue 44)
    def _bounded(self, ep: Episode, text: str, in_room: bool = True) -> str:
        """``text`` (a tool result or an observation) cut at ``rollout.max_tool_tokens``, and
        with ``in_room`` at one token past the episode's room (it will not be appended then:
        no need to tokenise more of it); counted when cut."""
        room = self._room(ep) if in_room else None
        text, cut = self.agent.observations.cut(text, None if room is None else max(0, room) + 1)
        ep.counts.truncated += cut
        return text

    def _room(self, ep: Episode) -> int | None:
        """Context tokens the episode can still append and leave a next model turn room: at
        least one token under ``rollout.max_episode_tokens``, and ``rollout.max_new_tokens``
        within the engine's context. None: unbounded."""
        rooms = [self.agent.max_episode_tokens - 1 - len(ep.traj.ids)] if self.agent.max_episode_tokens else []
        if self.limit is not None:
            rooms.append(self.limit - self.params.max_new_tokens - len(ep.traj.prompt_ids) - len(ep.traj.ids))
        return min(rooms, default=None)

    def _next_turn_fits(self, ep: Episode, appended: int) -> bool:
        room = self._room(ep)
        return room is None or appended <= room

    def _raw_text(self, ids) -> str:
        """The turn's text with special tokens kept (a format's tags may be special tokens),
        its final stop token removed."""
        stops = set(getattr(self.codec, "stop_token_ids", []) or [])
        while ids and ids[-1] in stops:
            ids = ids[:-1]
        return self.codec.tokenizer.decode(list(ids), skip_special_tokens=False)


def _with_observation(prompt, text: str):
    """The prompt with ``text`` appended to its last user message (a plain prompt: to itself)."""
    if isinstance(prompt, str):
        return f"{prompt}\n\n{text}"
    messages = [dict(m) for m in prompt]
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        return messages + [{"role": "user", "content": text}]
    messages[last]["content"] = f"{messages[last]['content']}\n\n{text}"
    return messages


__all__ = ["Episode", "EpisodeRunner", "FINISHED", "context_limit", "turn_seed"]
