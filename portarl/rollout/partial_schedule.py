"""When the async worker hands out a batch in partial-rollout mode, and what the batch says
(``rollout.partial``; the pool itself is :mod:`portarl.rollout.partial`).

The trainer sends, at the start of step t, the weights of version t - 1 and then the
requests up to step ``t + max_staleness`` (:mod:`portarl.trainer.asynchronous.pipeline`).
The worker owes the batch of step k once it has read the request of step ``min(k + lead,
train.steps)``, ``lead = max(max_staleness - 1, 0)``: everything it decodes for that batch
is then decided by the message stream, never by timing. With ``max_staleness`` >= 1 that
request comes at the start of step k - 1, after version k - 2: the worker decodes batch k
while the trainer learns from batch k - 1 (one step ahead, as plain async mode), and the
tokens carried from earlier decodes (versions down to k - 1 - max_staleness) are still
young enough for it: they carry across ``max_staleness - 1`` batches. (Owed at ``k +
max_staleness``, the batch came due when the trainer already waited for it: the two
processes took turns.) Each request's groups join the pool at once; the batch of
step k is the first ``prompts_per_step`` groups to complete, whichever request they came
from.

Its reply is an ordinary batch reply (tokens, log-probs, rewards) plus, per group, the
trainer's index of its prompt and the step that asked for it; per sample its original seed
and the weight version of each token; and the pool's counters. ``version`` is the oldest
token's version, so the trainer's staleness rule holds for every token.

A checkpoint saves the pool (``pool_state``): every sequence in flight with its tokens,
log-probs and versions, the batches owed, and the counters; a resumed run's worker starts
from it (``pool_restore``), so the resumed run goes on exactly as the uninterrupted one
(nothing lost, nothing counted twice).
"""

from __future__ import annotations

import bisect
import os
import time

from portarl.rollout.base import RolloutBatch
from portarl.rollout.partial import PartialPool


def partial_lead(max_staleness: int) -> int:
    """The batch of step k is owed once the request of step k + this is read (module doc)."""
    return max(max_staleness - 1, 0)


class PartialSchedule:
    def __init__(self, cfg):
        r = cfg.rollout
        self.pool = PartialPool(r.max_new_tokens, r.max_staleness, r.partial_overflow, r.partial_segment,
                                max_rows=r.max_batch_size)
        self.group_size, self.per_step = r.group_size, cfg.train.prompts_per_step
        self.staleness, self.last_step, self.run_seed = r.max_staleness, cfg.train.steps, cfg.train.seed
        self.lead = partial_lead(r.max_staleness)
        self.seed_mode = r.seed_mode
        self.owed: list[int] = []  # steps whose batch is owed, oldest first
        self.read_through = 0      # the newest step requested

    def request(self, worker, request: dict):
        """A generate request: its groups join the pool; yields the batches now due, each as
        soon as it is made (at the last steps several come due at once: the first must not
        wait for the later ones)."""
        from portarl.rollout import request_seeds

        step = int(request["step"])
        prompts = request["prompts"]
        mode = "constant" if worker.fault == "constant_seed" else self.seed_mode
        seeds = request_seeds(self.run_seed, step, len(prompts), self.group_size, mode)
        self.pool.add(step, prompts, request["examples"], request["indices"], seeds, self.group_size)
        if step not in self.owed:  # in step order: a step asked again (a dropped batch) is owed first
            bisect.insort(self.owed, step)
        self.read_through = max(self.read_through, step)
        while self.owed and self.read_through >= min(self.owed[0] + self.lead, self.last_step):
            yield self.batch(worker, self.owed.pop(0))

    def batch(self, worker, step: int):
        from portarl.assets.data import example_from_json
        from portarl.runtime import blackbox

        if worker.version is None:
            raise RuntimeError(f"asked for step {step} before any weights were published")
        if worker.fault_step == step and worker.fault == "die":
            os._exit(3)
        if worker.fault_step == step and worker.fault == "hang":
            while True:
                time.sleep(60)
        blackbox.note(step=step, phase="rollout")
        idle = time.perf_counter() - worker.idle_since
        started = time.perf_counter()
        self.pool.expire((step - 1) - self.staleness)  # no token of the batch older than the trainer allows
        stats = self.pool.decode(worker.engine, worker.sampling, worker.version, self.per_step)
        groups = self.pool.take(self.per_step)
        if len(groups) < self.per_step:
            raise RuntimeError(f"the partial-rollout pool holds {len(groups)} complete groups for step {step}, "
                               f"{self.per_step} needed")
        samples = [s for g in groups for s in g.samples]
        batch = RolloutBatch([list(s.prompt) for s in samples], [list(s.tokens) for s in samples],
                             [list(s.logprobs) for s in samples], [s.finished for s in samples])
        texts = [worker.codec.decode(c) for c in batch.completion_ids]
        rows = [example_from_json(g.example) for g in groups for _ in g.samples]
        versions = [list(s.versions) for s in samples]
        oldest = min((v[0] for v in versions if v), default=worker.version)
        reply = {"op": "batch", "step": step, "version": oldest, "seeds": [s.seed for s in samples],
                 "indices": [g.index for g in groups], "origin_steps": [g.step for g in groups],
                 "token_versions": versions, "restarts": [s.restarts for s in samples],
                 "partial": {**stats, **self.pool.stats, "in_flight_groups": self.pool.in_flight(),
                             "complete_waiting": len(self.pool.complete)}}
        out = worker.scored_reply(reply, step, rows, texts, batch, time.perf_counter() - started, idle, started)
        worker.idle_since = time.perf_counter()
        return out

    def state_reply(self) -> dict:
        return {"op": "pool", "state": {"pool": self.pool.state(), "owed": list(self.owed),
                                        "read_through": self.read_through}}

    def restore(self, state: dict) -> dict:
        self.pool.restore(state["pool"])
        self.owed, self.read_through = list(state["owed"]), int(state["read_through"])
        return {"op": "restored", "owed": list(self.owed)}


__all__ = ["PartialSchedule", "partial_lead"]
