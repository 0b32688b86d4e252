"""Rollout engines: sample G completions per prompt and record their log-probs."""

from portarl.rollout.base import (
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    identical_group_fraction,
    request_seeds,
    sample_seed,
)
from portarl.rollout.hf import HFRollout
from portarl.rollout.replay import RecordingRollout, ReplayRollout

ENGINES = {"hf": HFRollout}

__all__ = [
    "ENGINES",
    "HFRollout",
    "RecordingRollout",
    "ReplayRollout",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "identical_group_fraction",
    "request_seeds",
    "sample_seed",
]
