"""portarl: GRPO-family RL post-training with the same numbers on CUDA GPUs and Ascend NPUs."""

import importlib

__version__ = "0.1.0"

# Imported on first use (torch is heavy, the trainer needs transformers): ``python -m
# portarl`` then reaches the CLI before torch is imported, and the CLI turns Ctrl-C or
# SIGTERM during start-up into a clean exit instead of a traceback.
_LAZY = {
    "ops": ("portarl.ops", None),
    "Backend": ("portarl.backends", "Backend"),
    "BackendUnavailableError": ("portarl.backends", "BackendUnavailableError"),
    "get_backend": ("portarl.backends", "get_backend"),
    "DeviceUnavailableError": ("portarl.device", "DeviceUnavailableError"),
    "resolve_device": ("portarl.device", "resolve_device"),
    "GRPOTrainer": ("portarl.trainer", "GRPOTrainer"),
    "TrainConfig": ("portarl.trainer", "TrainConfig"),
}


def __getattr__(name):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
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
