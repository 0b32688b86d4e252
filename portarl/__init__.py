"""portarl: GRPO-family RL post-training with the same numbers on CUDA GPUs and Ascend NPUs.

Everything here is imported on first use (PEP 562 ``__getattr__``): ``import portarl`` does
not import torch, so ``portarl --help`` and ``portarl --version`` answer at once.
"""

import importlib

__version__ = "0.1.0"

#: public name -> module that defines it
_LAZY = {
    "ops": "portarl.ops",
    "Backend": "portarl.backends",
    "BackendUnavailableError": "portarl.backends",
    "get_backend": "portarl.backends",
    "DeviceUnavailableError": "portarl.backends.device",
    "resolve_device": "portarl.backends.device",
    # The trainer needs transformers.
    "GRPOTrainer": "portarl.trainer",
    "TrainConfig": "portarl.trainer",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'portarl' has no attribute {name!r}")
    if name == "ops":
        return importlib.import_module(module)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


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
