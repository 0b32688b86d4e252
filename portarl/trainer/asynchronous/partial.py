"""The trainer's side of partial rollouts (``rollout.partial``; the worker's pool is
:mod:`portarl.rollout.partial`): which prompts a batch answers, what its tokens' versions
say, and the pool kept in a checkpoint.

A partial batch answers the first groups the worker completed, whichever step asked for
them, so the trainer reads its prompts from the reply (the trainer's index of each group's
prompt) rather than from the step. Per token the reply carries the weight version that
sampled it; the metrics:

- ``rollout/token_staleness_mean`` / ``_max``: (step - 1) - version, per token;
- ``rollout/versions_per_sample``: distinct versions in a sample, averaged;
- ``rollout/carried_frac``: the share of the batch's groups asked for by an earlier step;
- ``rollout/restarted_frac``: samples restarted at least once (``partial_overflow: restart``);
- ``rollout/pool_groups``: groups left in flight in the worker, ``rollout/pool_decoded_tokens``
  the tokens this batch's decode produced (kept or not), ``rollout/pool_discarded_tokens``
  those thrown away so far (restarts, past a row's limit).
"""

from __future__ import annotations

from portarl.trainer.asynchronous.client import RolloutWorkerError


def partial_examples(trainer, reply: dict, name: str) -> list:
    """The examples a partial batch answers (``reply["indices"]``), checked."""
    indices = reply.get("indices")
    want = trainer.config.train.prompts_per_step
    n = len(trainer.examples)
    if (not isinstance(indices, list) or len(indices) != want
            or not all(isinstance(i, int) and 0 <= i < n for i in indices)):
        raise RolloutWorkerError(f"the {name} sent a partial batch whose prompt indices are not {want} indices into "
                                 f"the {n} examples: {str(indices)[:200]}")
    return [trainer.examples[i] for i in indices]


def partial_metrics(reply: dict, step: int) -> dict:
    versions = reply.get("token_versions") or []
    tokens = [v for sample in versions for v in sample]
    stale = [(step - 1) - v for v in tokens]
    origin = reply.get("origin_steps") or []
    pool = reply.get("partial", {})
    return {
        "rollout/token_staleness_mean": sum(stale) / len(stale) if stale else 0.0,
        "rollout/token_staleness_max": float(max(stale, default=0)),
        "rollout/versions_per_sample": sum(len(set(v)) for v in versions) / max(1, len(versions)),
        "rollout/carried_frac": sum(s < step for s in origin) / max(1, len(origin)),
        "rollout/restarted_frac": sum(r > 0 for r in reply.get("restarts", [])) / max(1, len(versions)),
        "rollout/pool_groups": float(pool.get("in_flight_groups", 0)),
        "rollout/pool_decoded_tokens": float(pool.get("decoded_tokens", 0)),
        "rollout/pool_discarded_tokens": float(pool.get("discarded_tokens", 0)),
    }


def pool_state(pipeline) -> dict:
    """Rank 0: the worker's pool (its sequences in flight, the batches it owes), asked for
    in the message stream: nothing it decodes depends on when."""
    pipeline.pool_state = None
    pipeline.client.send({"op": "pool_state"})
    while pipeline.pool_state is None:
        pipeline._receive("the rollout worker's pool of sequences in flight", pipeline.client)
    return {"partial_pool": pipeline.pool_state}


def restore_pool(pipeline, saved) -> bool:
    """Rank 0 of a resumed run: the checkpoint's pool back into the new worker; requests go
    on after the newest one it holds. False when the checkpoint holds none."""
    if not isinstance(saved, dict) or "partial_pool" not in saved:
        return False
    state = saved["partial_pool"]
    pipeline.client.wait_ready()  # its start-up ends with "ready"
    pipeline.client.send({"op": "pool_restore", "state": state})
    pipeline.restored = False
    while not pipeline.restored:
        pipeline._receive("the rollout worker to restore its pool", pipeline.client)
    pipeline.next_request = max(pipeline.trainer.step, int(state["read_through"])) + 1
    for entry in saved.get("batches", []):  # made before the checkpoint, not yet trained on
        pipeline.batches[int(entry["step"])] = entry["reply"]
    return True


__all__ = ["partial_examples", "partial_metrics", "pool_state", "restore_pool"]
