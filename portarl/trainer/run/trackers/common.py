"""What every tracker module shares (:mod:`portarl.trainer.run.trackers`): the run a tracker
is started for, and how a setting left null defers to the tracker's own environment variable.
Below the fan-out and the tracker modules, so that neither imports the other for these."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


@dataclasses.dataclass
class RunInfo:
    """What every tracker is started with."""

    #: The run's resolved config (``TrainConfig.to_dict()``): logged as the run's config.
    config: dict
    #: The output directory (trackers that write files default to a folder inside it).
    output_dir: Path
    #: The name a tracker's run gets when its settings and environment give none.
    default_name: str
    #: The step the run starts from (0, or the checkpoint's on --resume).
    start_step: int


def setting(value, env: tuple[str, ...], default):
    """A tracker setting: ``value`` when the config sets it; None when one of the tracker's
    environment variables ``env`` is set (the tracker reads it itself, in its own way);
    otherwise portarl's ``default``."""
    if value is not None:
        return value
    if any(os.environ.get(name) for name in env):
        return None
    return default


def flat_config(config: dict, prefix: str = "") -> dict[str, str]:
    """The config as ``section.field -> text`` (lists and null as JSON): the key / value
    parameters a tracker without nested config (MLflow) shows."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_config(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


__all__ = ["RunInfo", "flat_config", "setting"]
