"""GRPO training: :class:`GRPOTrainer` (``grpo.py``) and its loop (``loop.py``); a step's
phases in ``phases/``, the config in ``config/``, ``rollout.mode: async`` in ``asynchronous/``,
the guards in ``guards/``, the run around the steps in ``run/``, its start (preflight, build, setup) in ``start/``, memory in ``memory/`` and
checkpoint files in ``checkpoint/``."""

from portarl.trainer.config import ConfigError, TrainConfig
from portarl.trainer.start.build import build_from_config
from portarl.trainer.grpo import GRPOTrainer, TrainingStopped, TrainResult

__all__ = ["ConfigError", "GRPOTrainer", "TrainConfig", "TrainResult", "TrainingStopped", "build_from_config"]
