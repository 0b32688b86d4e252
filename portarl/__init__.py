"""portarl: GRPO-family RL post-training with the same numbers on CUDA GPUs and Ascend NPUs."""

from portarl import ops
from portarl.backends import Backend, BackendUnavailableError, get_backend
from portarl.device import DeviceUnavailableError, resolve_device

__version__ = "0.1.0"


def __getattr__(name):
    # The trainer needs transformers; import it only when asked for.
    if name in ("GRPOTrainer", "TrainConfig"):
        import portarl.trainer

        return getattr(portarl.trainer, name)
    raise AttributeError(f"module 'portarl' has no attribute {name!r}")


__all__ = [
    "Backend",
    "BackendUnavailableError",
    "DeviceUnavailableError",
    "GRPOTrainer",
    "TrainConfig",
    "__version__",
    "get_backend",
    "ops",
    "resolve_device",
]
