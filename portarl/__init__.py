"""portarl: GRPO-family RL post-training with the same numbers on CUDA GPUs and Ascend NPUs."""

from portarl import ops
from portarl.backends import Backend, BackendUnavailableError, get_backend
from portarl.device import DeviceUnavailableError, resolve_device

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "DeviceUnavailableError",
    "__version__",
    "get_backend",
    "ops",
    "resolve_device",
]
