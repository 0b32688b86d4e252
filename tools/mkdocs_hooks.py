"""mkdocs hooks: docs/configuration.md's field reference is generated from the config
dataclasses at build time (tools/config_reference.py), so it cannot drift from the code."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- CONFIG_FIELDS -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    for path in (str(ROOT), str(ROOT / "tools")):
        if path not in sys.path:
            sys.path.insert(0, path)
    from config_reference import reference

    return markdown.replace(MARKER, reference())
