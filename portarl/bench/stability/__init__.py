"""Training-stability comparison: the same config trained under several settings, on one
machine or several.

- :mod:`.runs`: run specs (``device:dtype[:variant][@section.field=value...]``)
- :mod:`.record`: the run directory (manifest, config, start model, rollouts, per-run data)
- :mod:`.archive`: the run directory as one ``.tar`` (``pack_record``), read back safely
- :mod:`.worker`: one run in its own process (native crashes become that run's verdict)
- :mod:`.analysis`: parting steps against a measured noise floor, token-level divergence
- :mod:`.loss_gap`: the mean relative loss gap to the baseline (the Ascend community's 2% rule)
- :mod:`.report`: ``report.md``, ``stability.png``, ``tokens.png``
- :mod:`.harness`: record / replay-from / compare; :mod:`.cli`: the ``bench stability`` commands
- :mod:`.dump` / :mod:`.dump_index` / :mod:`.dump_step`: one step's forward and backward dumped per
  module (safetensors + JSON index + msprobe's L0 dump.json); :mod:`.locator` /
  :mod:`.locate_report`: where two dumps part, module by module
"""

import importlib

# Lazy: ``portarl --help`` wires this package's arguments without importing torch.
_EXPORTS = {
    "analyse": "analysis", "first_divergence": "analysis", "token_divergence": "analysis",
    "mean_relative_loss_gap": "loss_gap", "open_record": "archive", "pack_record": "archive",
    "UnsafeArchive": "archive",
    "compare": "harness", "run_stability": "harness",
    "ReplayMismatch": "record", "RunResult": "record", "load_directory": "record",
    "dump_modules": "dump", "dump_recorded_step": "dump_step", "locate": "locator",
    "BACKENDS": "runs", "METRICS": "runs", "RunSpec": "runs", "parse_runs": "runs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
