"""Partial rollouts (``rollout.partial``): the async worker's pool of sequences in flight.

Why: with long-tailed completion lengths a batch-synchronous rollout decodes for its
longest sample while every other row of the batch is done. Here the worker keeps the
groups of every step it was asked for in one pool, decodes them together, and hands the
trainer a step's batch as soon as ``prompts_per_step`` groups are complete (every sample
ended: a stop token, the token limit, or cut); the rest stay in flight, their tokens kept,
and go on in the next step's decode, after the weights the trainer published meanwhile are
loaded: their later tokens come from newer weights.

Deterministic by construction, so that a run and its resume agree bitwise: the pool is
decoded only while a batch is owed, and a batch owed for step k is produced once the
worker has read the requests up to step ``k + max_staleness`` (the trainer sends those
before it waits for batch k) and every weight message before them, in the order sent.
Between two batches the pool's composition, the weights and the stopping point are
functions of the message stream alone. A batch's groups are the first complete ones, in
order of completion (ties: in the order the groups were asked for).

Across weight versions a sequence is re-prefilled under the new weights from its prompt and
the tokens it has (verl's fully async design), not continued from a KV cache computed under
the old ones (PipelineRL): every token after the switch is the new policy's own, so the
behaviour log-probs each token carries are exact. Each decode call re-prefills the pool's
carried sequences; its random stream goes on from a seed derived from the sample's seed and
its tokens so far (:func:`continuation_seed`).

A sequence that would span more than ``rollout.max_staleness`` + 1 weight versions when a
version loads is restarted (``rollout.partial_overflow: restart``: its tokens dropped, it
samples again from its prompt with the new weights) or cut (``cut``: ended where it is,
unfinished, like a sample that hit the token limit). So a token trained at step t was
sampled by version t - 1 - max_staleness or later, the async rule; ``restart`` keeps the
sample distribution of the newest weights at the cost of the tokens thrown away, ``cut``
keeps every token and biases toward shorter samples (see docs/async.md).

Every token carries the version that sampled it and its behaviour log-prob; the trainer's
mismatch correction weighs each token by them (:mod:`portarl.core.mismatch`).
"""

from __future__ import annotations

import dataclasses
import time

from portarl.rollout import bench_lengths
from portarl.rollout.base import SamplingParams, seed_of

OVERFLOW = ("restart", "cut")


def continuation_seed(seed: int, tokens: int) -> int:
    """The seed a sample's stream goes on with after ``tokens`` sampled ones (its own seed at 0)."""
    return seed if tokens == 0 else seed_of(f"{seed}/partial/{tokens}")


@dataclasses.dataclass
class Sample:
    seed: int
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False  # ended with a stop token
    done: bool = False      # finished, at the token limit, or cut
    restarts: int = 0


@dataclasses.dataclass
class Group:
    step: int             # the request (step) that asked for it
    index: int            # its prompt's index in the trainer's examples
    example: dict         # the example, as JSON (the rewards read it)
    samples: list[Sample]
    order: int = 0        # arrival order in the pool (ties in completion order)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)


class PartialPool:
    """The groups in flight, and the complete groups not yet handed out (FIFO)."""

    def __init__(self, max_new_tokens: int, max_staleness: int, overflow: str = "restart", segment: int = 64,
                 max_rows: int | None = None):
        """``max_rows`` (``rollout.max_batch_size``): rows per decode call at most; the groups
        in flight beyond it, in arrival order, wait for a later call (whole groups only)."""
        if overflow not in OVERFLOW:
            raise ValueError(f"rollout.partial_overflow={overflow!r} must be one of {', '.join(OVERFLOW)}")
        self.max_new_tokens, self.max_staleness, self.overflow, self.segment = (max_new_tokens, max_staleness,
                                                                                overflow, segment)
        self.max_rows = max_rows
        self.groups: list[Group] = []     # in flight
        self.complete: list[Group] = []   # done, not handed out, in completion order
        self.arrivals = 0
        self.stats = {"restarted": 0, "cut": 0, "discarded_tokens": 0}

    # ------------------------------------------------------------------ the pool
    def add(self, step: int, prompts: list[list[int]], examples: list[dict], indices: list[int], seeds: list[int],
            group_size: int) -> None:
        for i, (prompt, example, index) in enumerate(zip(prompts, examples, indices)):
            samples = [Sample(seed=seeds[i * group_size + j], prompt=list(prompt)) for j in range(group_size)]
            self.groups.append(Group(step, index, example, samples, order=self.arrivals))
            self.arrivals += 1

    def in_flight(self) -> int:
        return len(self.groups)

    def on_version(self, version: int) -> None:
        """Weights ``version`` were loaded: a sequence that would now span more than
        ``max_staleness`` + 1 versions is restarted or cut (:attr:`overflow`)."""
        for group in self.groups:
            for s in group.samples:
                if s.done or not s.versions or version - s.versions[0] <= self.max_staleness:
                    continue
                if self.overflow == "restart":
                    self.stats["restarted"] += 1
                    self.stats["discarded_tokens"] += len(s.tokens)
                    s.tokens, s.logprobs, s.versions = [], [], []
                    s.restarts += 1
                else:
                    self.stats["cut"] += 1
                    s.done = True
        self._collect()

    def expire(self, oldest_allowed: int) -> int:
        """Restart every sample, done or not, holding a token older than ``oldest_allowed``
        (the batch of step k may hold no token older than version k - 1 - max_staleness); a
        complete group with such a sample goes back in flight, in arrival order. Returns how
        many restarted.

        Why: :meth:`on_version` bounds the versions a sequence spans, counted from the worker's
        newest version, and never looked at done samples; but a batch can be handed while the
        worker's version itself lags the step by up to max_staleness, and a group that completed
        early waits in :attr:`complete`. Such a batch came out too stale, the trainer dropped it
        and asked for its step again, and the worker (owing the next step first) never answered:
        the run hung with long-tailed lengths (found by ``bench async --lengths tail:4:96``)."""
        restarted = 0
        back = []
        for group in [*self.groups, *self.complete]:
            for s in group.samples:
                if s.versions and s.versions[0] < oldest_allowed:
                    self.stats["restarted"] += 1
                    self.stats["discarded_tokens"] += len(s.tokens)
                    s.tokens, s.logprobs, s.versions = [], [], []
                    s.finished = s.done = False
                    s.restarts += 1
                    restarted += 1
            if not group.done and group in self.complete:
                back.append(group)
        if back:
            self.complete = [g for g in self.complete if g not in back]
            self.groups = sorted([*self.groups, *back], key=lambda g: g.order)
        return restarted

    def _collect(self) -> None:
        """Move the groups whose every sample is done to :attr:`complete`, in arrival order."""
        still = []
        for group in self.groups:
            (self.complete if group.done else still).append(group)
        self.groups = still

    def take(self, n: int) -> list[Group]:
        out, self.complete = self.complete[:n], self.complete[n:]
        return out

    # ------------------------------------------------------------------ decoding
    def _active(self) -> list[tuple[Group, Sample]]:
        """The samples of the next call: every group's not-done ones, whole groups in arrival
        order up to :attr:`max_rows` rows (at least one group)."""
        out = []
        for g in self.groups:
            rows = [(g, s) for s in g.samples if not s.done]
            if out and self.max_rows is not None and len(out) + len(rows) > self.max_rows:
                break
            out += rows
        return out

    def decode(self, engine, params: SamplingParams, version: int, need: int) -> dict:
        """Decode the pool with the engine's current weights (``version``) until ``need``
        groups are complete (or nothing is left to decode); returns counters."""
        started, calls, decoded = time.perf_counter(), 0, 0
        while len(self.complete) < need and self.groups:
            active = self._active()
            calls += 1
            decoded += self._decode_once(engine, params, version, active, need - len(self.complete))
            self._collect()
        return {"calls": calls, "decoded_tokens": decoded, "seconds": time.perf_counter() - started}

    def _decode_once(self, engine, params, version, active, need) -> int:
        """One engine call over the ``active`` samples: each row is its prompt and the tokens
        it has; it stops where ``need`` more groups are complete (an engine that can stop
        early), else after :attr:`segment` tokens."""
        prompts = [s.prompt + s.tokens for _, s in active]
        seeds = [continuation_seed(s.seed, len(s.tokens)) for _, s in active]
        limits = [self.max_new_tokens - len(s.tokens) for _, s in active]
        early = getattr(engine, "supports_stop_when", False)
        steps = max(limits) if early else min(self.segment, max(limits))
        group_of = [id(g) for g, _ in active]
        order = {gid: k for k, gid in enumerate(dict.fromkeys(group_of))}
        rows_group = [order[g] for g in group_of]
        kwargs = {"row_limits": limits, "stop_when": _complete_counter(rows_group, len(order), need)} if early else {}
        if early and bench_lengths.spec():  # benchmark lengths: from the sample's own seed and its tokens so far
            kwargs["end_at"] = [bench_lengths.target_length(s.seed) - len(s.tokens) for _, s in active]
        batch = engine.generate(prompts, seeds, dataclasses.replace(params, max_new_tokens=steps), **kwargs)
        decoded = 0
        for (_, s), tokens, logps, finished, limit in zip(active, batch.completion_ids, batch.logprobs,
                                                           batch.finished, limits):
            keep = min(len(tokens), limit)
            self.stats["discarded_tokens"] += len(tokens) - keep
            decoded += len(tokens)
            s.tokens += tokens[:keep]
            s.logprobs += logps[:keep]
            s.versions += [version] * keep
            s.finished = bool(finished) and keep == len(tokens)
            s.done = s.finished or len(s.tokens) >= self.max_new_tokens
        return decoded

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        """JSON: everything in flight and complete but not handed out, and the counters."""
        def group_json(g: Group) -> dict:
            return {"step": g.step, "index": g.index, "example": g.example, "order": g.order,
                    "samples": [dataclasses.asdict(s) for s in g.samples]}
        return {"groups": [group_json(g) for g in self.groups], "complete": [group_json(g) for g in self.complete],
                "arrivals": self.arrivals, "stats": dict(self.stats)}

    def restore(self, state: dict) -> None:
        def group_of(d: dict) -> Group:
            return Group(d["step"], d["index"], d["example"], [Sample(**s) for s in d["samples"]], d["order"])
        self.groups = [group_of(d) for d in state["groups"]]
        self.complete = [group_of(d) for d in state["complete"]]
        self.arrivals = int(state["arrivals"])
        self.stats = dict(state["stats"])


def _complete_counter(rows_group: list[int], groups: int, need: int):
    """``stop_when(done) -> bool`` for the hf engine: whether ``need`` groups of the call have
    every row done (``done``: a [rows] bool tensor on the device; one host sync per token,
    as the engine's own all-done check)."""
    import torch

    index = {}

    def stop_when(done: torch.Tensor) -> bool:
        if "t" not in index:
            index["t"] = torch.tensor(rows_group, dtype=torch.long, device=done.device)
        pending = torch.zeros(groups, dtype=torch.long, device=done.device).index_add_(0, index["t"], (~done).long())
        return bool((pending == 0).sum() >= need)

    return stop_when


__all__ = ["Group", "OVERFLOW", "PartialPool", "Sample", "continuation_seed"]
