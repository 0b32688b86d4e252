"""GRPO training: the trainer, its config, guards, checkpoints and logging."""

from portarl.trainer.config import ConfigError, TrainConfig
from portarl.trainer.grpo import GRPOTrainer, TrainingStopped, TrainResult, build_from_config

__all__ = ["ConfigError", "GRPOTrainer", "TrainConfig", "TrainResult", "TrainingStopped", "build_from_config"]
