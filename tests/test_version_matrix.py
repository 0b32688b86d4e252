"""The Ascend version matrix: ``portarl[npu]`` pins the torch / torch-npu pair it is written
for, and docs/hardware-ci.md names the pinned versions with the date they were checked, so
a pin cannot change without the page saying what was checked."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins(requirements: list[str]) -> dict[str, str]:
    out = {}
    for req in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.+]*)", req.strip())
        assert match, f"{req!r}: the npu extra pins exact versions"
        out[match[1].lower()] = match[2]
    return out


def test_the_npu_extra_pins_a_torch_npu_pair():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = _pins(extras["npu"])
    assert set(pins) == {"torch", "torch-npu"}
    # torch-npu X.Y.Z[.postN] requires torch X.Y.Z
    assert pins["torch-npu"].split(".post")[0] == pins["torch"]


def test_the_matrix_names_every_pinned_version_with_a_date():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = _pins(extras["npu"])
    page = (ROOT / "docs" / "hardware-ci.md").read_text()
    section = page[page.index("## Ascend version matrix"):]
    row = next(line for line in section.splitlines() if line.startswith("| `portarl[npu]`"))
    assert f"torch {pins['torch']}, torch-npu {pins['torch-npu']}" in row
    assert re.search(r"\| 20\d\d-\d\d-\d\d \|", row), "the row says when it was last checked"
    spec = re.search(r"^TRITON_ASCEND_SPEC \?= triton-ascend==(\S+)", (ROOT / "Makefile").read_text(), re.M)[1]
    triton_row = next(line for line in section.splitlines() if line.startswith("| Triton kernels on Ascend"))
    assert f"triton-ascend {spec}" in triton_row and re.search(r"\| 20\d\d-\d\d-\d\d \|", triton_row)
