"""Every config the project ships (examples/, bench/configs/) loads, and the data file it
names exists: a relative data.path means the config file's directory, and
bench/configs/smollm2-readme.yaml once pointed below itself, so the command docs/memory.md
gives failed with "data file ... does not exist" after the model had loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from portarl.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted([*ROOT.glob("examples/*.yaml"), *ROOT.glob("bench/configs/*.yaml")])


def test_there_are_shipped_configs():
    assert len(SHIPPED) >= 2, SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_shipped_config_loads_and_its_data_exists(path):
    cfg = TrainConfig.load(path)
    if cfg.data.path is not None:
        assert Path(cfg.data.path).is_file(), f"{path.relative_to(ROOT)}: data.path {cfg.data.path} does not exist"
    if cfg.tools or cfg.environment is not None:  # the tools it names load, with their schemas (docs/agents.md)
        from portarl.multiturn.environment import load_factories
        from portarl.multiturn.tools import load_tools

        assert len(load_tools(cfg.tools, [cfg.source_dir])) == len(cfg.tools)
        load_factories(cfg.environment, [cfg.source_dir])
