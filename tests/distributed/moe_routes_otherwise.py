"""A reward module for tests/distributed/test_moe_fsdp.py whose import makes the hf rollout
engine route otherwise than the trainer on some tokens, in every process that loads it
(each torchrun rank imports its rewards; a test cannot monkeypatch another process).

Why: with an engine that routes as the trainer does, routing replay is invisible (the
replayed experts are the ones the trainer would choose anyway), so a replay that went
wrong on one rank would pass. Here the engine takes the 1st and 3rd most probable experts
where the most probable one is odd: a rule of each token's own probabilities, not of its
batch, so one process and two ranks (which decode other batch shapes) route alike, and the
trainer's log-probs match the engine's only if every rank replays its own recorded experts.
"""

from __future__ import annotations

import torch

from dist_rewards import length_and_digits  # noqa: F401  (the reward the test names)
from portarl.moe import routing
from portarl.rollout.hf import HFRollout


def _choose_otherwise(probs: torch.Tensor, k: int) -> torch.Tensor:
    order = torch.argsort(probs, dim=-1, descending=True)
    other = torch.cat([order[:, :1], order[:, 2:3], order[:, 3:k + 1]], dim=-1)[:, :k]
    return torch.where((order[:, :1] % 2 == 1), other, order[:, :k])


_generate = HFRollout.generate


def _generate_routing_otherwise(self, *args, **kwargs):
    original = routing.choose
    routing.choose = _choose_otherwise
    try:
        return _generate(self, *args, **kwargs)
    finally:
        routing.choose = original


HFRollout.generate = _generate_routing_otherwise
