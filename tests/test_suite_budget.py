"""The rules of tests/suite_budget.py: what make test leaves to make test-full keeps a cover."""

from __future__ import annotations

import re
import types

import pytest

import suite_budget


def _items(*nodeids):
    return [types.SimpleNamespace(nodeid=f"tests/{n}") for n in nodeids]


@pytest.fixture
def table(monkeypatch):
    entries = {}
    monkeypatch.setattr(suite_budget, "FULL_ONLY", entries)
    return entries


def test_a_full_only_test_is_skipped_with_what_covers_it(table):
    table["a/test_x.py::test_slow[2]"] = (["a/test_x.py::test_slow[1]", "b/test_y.py::test_unit"], "the same path")
    reasons = suite_budget.check_full_only(_items("a/test_x.py::test_slow[1]", "a/test_x.py::test_slow[2]",
                                                  "b/test_y.py::test_unit"))
    assert reasons == {"tests/a/test_x.py::test_slow[2]": "make test-full only (covered in make test: the same path)"}


@pytest.mark.parametrize("entry, covers, says", [
    ("a/test_x.py::test_gone", ["a/test_x.py::test_slow"], "is not a test (renamed?)"),
    ("a/test_x.py::test_slow[2]", ["a/test_x.py::test_renamed"], "cover a/test_x.py::test_renamed is not a test"),
    ("a/test_x.py::test_slow[2]", ["a/test_x.py::test_slow[2]"], "runs in make test-full only"),
    ("a/test_x.py::test_slow[2]", [], "names no cover"),
])
def test_an_entry_without_a_live_cover_fails_the_collection(table, entry, covers, says):
    table[entry] = (covers, "...")
    with pytest.raises(pytest.UsageError, match=re.escape(says)):
        suite_budget.check_full_only(_items("a/test_x.py::test_slow[1]", "a/test_x.py::test_slow[2]"))


def test_a_cover_in_a_file_this_run_did_not_collect_is_not_judged(table):
    table["a/test_x.py::test_slow[2]"] = (["c/test_z.py::test_elsewhere"], "...")
    assert list(suite_budget.check_full_only(_items("a/test_x.py::test_slow[2]"))) == ["tests/a/test_x.py::test_slow[2]"]


def test_the_real_table_names_at_least_one_cover_each():
    assert suite_budget.FULL_ONLY and all(covers and keeps for covers, keeps in suite_budget.FULL_ONLY.values())
