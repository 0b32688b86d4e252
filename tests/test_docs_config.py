"""The configuration reference (docs/configuration.md, built by tools/config_reference.py)
lists every config field, so the page cannot fall behind a new field; and the docs pages
link only to pages that exist (``make docs`` runs the full ``mkdocs build --strict``)."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("yaml")


def _fields(prefix: str, instance) -> set[str]:
    names = set()
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            names |= _fields(f"{prefix}{f.name}.", value)
        else:
            names.add(f"{prefix}{f.name}")
    return names


def test_config_reference_lists_every_field():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from config_reference import field_names, reference
    finally:
        sys.path.remove(str(ROOT / "tools"))
    from portarl.trainer.config import TrainConfig
    from portarl.trainer.config_lora import LoraSection

    expected = _fields("", TrainConfig()) | _fields("model.lora.", LoraSection())
    assert expected <= field_names(), sorted(expected - field_names())
    assert "<!-- CONFIG_FIELDS -->" in (ROOT / "docs" / "configuration.md").read_text()
    assert "`rollout.identical_min_chance`" in reference()


def test_docs_links_point_at_pages_that_exist():
    for page in (ROOT / "docs").rglob("*.md"):
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).resolve().is_file(), f"{page.relative_to(ROOT)} links to missing {target}"
    nav = (ROOT / "mkdocs.yml").read_text()
    for target in re.findall(r":\s+(\S+\.md)\s*$", nav, flags=re.M):
        assert (ROOT / "docs" / target).is_file(), f"mkdocs.yml nav names missing docs/{target}"
