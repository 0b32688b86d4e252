"""What the async rollout tests look at on the trainer's side (tests/trainer and
tests/vllm_engine): the trainer's weights at every published version, the batch each step
received, and how far a batch's behaviour log-probs are from the trainer's under given
weights."""

from __future__ import annotations

import torch

from portarl.trainer.asynchronous.pipeline import AsyncRollout
from portarl.trainer.phases.sequences import build_batch, completion_logprobs


def capture_async(monkeypatch) -> tuple[dict, list]:
    """``(weights, batches)``, filled as the run goes: ``weights[version]`` is the trainer's
    state dict when it published that version; ``batches`` holds ``(step, version,
    RolloutBatch)`` for every batch handed to the trainer."""
    weights, batches = {}, []
    publish, batch = AsyncRollout._publish, AsyncRollout.batch

    def capture_publish(self):
        weights.setdefault(self.trainer.step, {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()})
        return publish(self)

    def capture_batch(self, step):
        got = batch(self, step)
        batches.append((step, int(got.metrics["rollout/version"]), got.rollout))
        return got

    monkeypatch.setattr(AsyncRollout, "_publish", capture_publish)
    monkeypatch.setattr(AsyncRollout, "batch", capture_batch)
    return weights, batches


def behaviour_gap(trainer, state: dict, rollout) -> float:
    """max |trainer log-prob under ``state`` - the rollout's behaviour log-prob| over every
    completion token (the trainer's model is left holding ``state``)."""
    model = trainer.model
    model.load_state_dict(state)
    b = build_batch(rollout.prompt_ids, rollout.completion_ids, trainer.codec.pad_token_id, "cpu")
    with torch.no_grad():
        ours = completion_logprobs(model, b, temperature=trainer.config.rollout.temperature)
    theirs = torch.zeros_like(ours)
    for i, lps in enumerate(rollout.logprobs):
        theirs[i, : len(lps)] = torch.tensor(lps)
    return (ours - theirs).abs()[b.mask].max().item()
