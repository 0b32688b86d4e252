"""Backend registry: names to lazily built singletons.

Backends are imported on first use so that ``import portarl`` needs neither triton nor
torch_npu.
"""

from __future__ import annotations

import importlib

from portarl.backends.base import Backend

_MODULES = {
    "reference": "portarl.backends.reference",
    "cuda": "portarl.backends.cuda",
    "npu": "portarl.backends.npu",
    "triton": "portarl.backends.triton_ascend",  # the Triton kernels on an NPU (triton-ascend)
}
BACKEND_NAMES = tuple(_MODULES)
_instances: dict[str, Backend] = {}


def get_backend_by_name(name: str, *, origin: str = "backend") -> Backend:
    if name not in _MODULES:
        raise ValueError(f"{origin}: unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name not in _instances:
        module = importlib.import_module(_MODULES[name])
        _instances[name] = module.BACKEND_CLASS()
    return _instances[name]
