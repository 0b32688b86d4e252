"""Issue 44: every list of the built-in rewards in the docs (and in the generated
configuration reference) names all of them; ``environment`` was missing from
docs/configuration.md, docs/models-and-data.md and docs/algorithms.md."""

from __future__ import annotations

import re
from pathlib import Path

from portarl.assets.rewards import BUILTIN_REWARDS

ROOT = Path(__file__).resolve().parents[1]
#: How the docs start a list of the built-in rewards.
LIST = re.compile(r"`math_exact`,\s+`format`")


def test_every_list_of_the_built_in_rewards_names_them_all():
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    lists = 0
    for page in pages:
        text = page.read_text()
        for found in LIST.finditer(text):
            listed = text[found.start():found.end() + 60]
            missing = [name for name in BUILTIN_REWARDS if f"`{name}`" not in listed]
            assert not missing, f"{page.relative_to(ROOT)}: {listed!r} leaves out {missing}"
            lists += 1
    assert lists >= 3  # configuration.md, models-and-data.md, algorithms.md
