"""portarl: GRPO-family RL post-training with the same numbers on CUDA GPUs and Ascend NPUs.

Everything here is imported on first use (PEP 562 ``__getattr__``): ``import portarl`` does
not import torch, so ``portarl --help`` and ``portarl --version`` answer at once.

The package by role (docs/getting-started.md, "Where things are"): ``cli/`` the command
line; ``bench/`` benchmarks; ``trainer/`` the GRPO trainer; ``rollout/``, ``multiturn/``,
``parity/`` and ``core/`` what it drives; ``assets/`` models, tokenizers, LoRA, data and
rewards; ``runtime/`` process-level plumbing; ``ops/`` the public ops; ``backends/`` (with
devices and numerics switches) and ``kernels/`` below them.
"""

import importlib
import importlib.abc
import importlib.util
import sys

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


#: Modules that were top-level before the package was grouped by role (issue 45), under the
#: names docs, examples and users' code import: ``import portarl.models`` (or ``from
#: portarl.data import Example``) still works and gives the very module object of its new
#: home (``portarl.assets.models``), so a monkeypatch through either name patches both.
MOVED = {
    "portarl.models": "portarl.assets.models",
    "portarl.tokenizer": "portarl.assets.tokenizer",
    "portarl.lora": "portarl.assets.lora",
    "portarl.data": "portarl.assets.data",
    "portarl.rewards": "portarl.assets.rewards",
    "portarl.reward_runner": "portarl.assets.reward_runner",
    "portarl.export": "portarl.trainer.checkpoint.export",
    "portarl.user_code": "portarl.runtime.user_code",
    "portarl.distributed": "portarl.runtime.distributed",
    "portarl.errors": "portarl.runtime.errors",
    "portarl.exit_path": "portarl.runtime.exit_path",
    "portarl.device": "portarl.backends.device",
    "portarl.emulation": "portarl.backends.emulation",
    "portarl.precision_switches": "portarl.backends.precision_switches",
    "portarl.envinfo": "portarl.backends.envinfo",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of :data:`MOVED` and loads it as its new module: ``exec_module``
    puts the new module in ``sys.modules`` under the old name, which is what the import
    system then returns (the new module's ``__name__`` and ``__spec__`` stay its own)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return None  # a placeholder, replaced in exec_module

    def exec_module(self, module):
        sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


if not any(isinstance(finder, _MovedModule) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModule())  # first: an old file left by an editable install must not win
