"""tools/docs_numbers.py's text handling (issue 33 item 13), fast: finding the quoted numbers
in a page, reporting the ones that moved, rewriting them, reading a run's summary and the
Makefile's demo command; every registered quote still finds its numbers in its page, and
the committed results the script regenerates (locate reports, the algorithm menu's tables)
agree with the pages that quote them. The jobs themselves (minutes to an hour) are not run
here: ``make docs-numbers``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from docs_quotes import (QUOTES, Quote, half_up, locate_figures, makefile_demo, mean_table, moved,  # noqa: E402
                         rewrite, summary_figures)

SUMMARY = """steps logged: 60 (GRPO)
reward/mean   first 10 steps: 0.249   last 10 steps: 0.324
accuracy      first 10 steps: 0.156   last 10 steps: 0.227
kl (mean of last 10 steps): 4.159e-01   grad_norm (mean of last 10 steps): 2.434
skipped steps: 0   spikes: 0   identical-group frac (mean): 0.020
"""
PAGE = "Intro.\nThe reward rises from 0.25 to\n0.34, accuracy 0.16.\nEnd.\n"
QUOTE = Quote("page.md", r"reward rises from (?P<a>[0-9.]+) to\s+(?P<b>[0-9.]+), accuracy (?P<acc>[0-9]+\.[0-9]+)", "demo",
              (("a", "reward_first"), ("b", "reward_last"), ("acc", "accuracy_last")))


def test_summary_figures_are_read_as_printed():
    assert summary_figures(SUMMARY) == {"reward_first": "0.249", "reward_last": "0.324", "accuracy_first": "0.156",
                                        "accuracy_last": "0.227", "spikes": "0"}
    with pytest.raises(ValueError, match="reward/mean"):
        summary_figures("steps logged: 0\n")


def test_a_moved_number_is_reported_and_rewritten_in_place():
    fresh = {"reward_first": "0.25", "reward_last": "0.36", "accuracy_last": "0.16"}
    assert moved(QUOTE, PAGE, fresh) == [("reward_last", "0.34", "0.36")]
    assert rewrite(QUOTE, PAGE, fresh) == PAGE.replace("0.34", "0.36")
    assert moved(QUOTE, PAGE, {**fresh, "reward_last": "0.34"}) == []
    assert moved(QUOTE, PAGE, {"reward_first": "0.25"})[0][2] == "<missing from the job's output>"


def test_line_breaks_inside_a_quote_are_not_a_change():
    quote = Quote("page.md", r"went (?P<steps>[0-9., \n]+?) \(end", "x")
    page = "went 0.19, 0.25,\n0.13 (end"
    assert moved(quote, page, {"steps": "0.19, 0.25, 0.13"}) == []
    assert rewrite(quote, page, {"steps": "0.19, 0.25, 0.13"}) == page  # the page's own wrapping kept
    assert moved(quote, page, {"steps": "0.19, 0.25, 0.14"}) == [("steps", "0.19, 0.25,\n0.13", "0.19, 0.25, 0.14")]


def test_per_step_rewards_are_rounded_as_the_page_prints_them():
    assert [half_up(v) for v in (0.125, 0.625, 0.1875, 0.5625, 0.0, 1.0)] == ["0.13", "0.63", "0.19", "0.56", "0.00",
                                                                              "1.00"]


def test_a_quote_missing_from_its_page_names_the_page():
    with pytest.raises(LookupError, match="page.md: the quote"):
        QUOTE.match("The reward rose.")


def test_the_demo_command_is_the_makefiles():
    threads, sets = makefile_demo((ROOT / "Makefile").read_text())
    assert threads == "1" and sets == ["--set", "train.steps=60", "--set", "optim.lr=1e-3"]


@pytest.mark.parametrize("quote", QUOTES, ids=lambda q: f"{q.job}:{q.doc}:{q.pattern[:24]}")
def test_every_quote_finds_its_numbers_in_its_page(quote):
    found = quote.match((ROOT / quote.doc).read_text())
    assert found.groupdict() and all(found.groupdict().values())


def _committed(job: str) -> dict[str, str]:
    if job == "locate":
        out = {}
        for step in (1, 9):
            report = json.loads((ROOT / f"bench/results/locate-cpu-emulation/step{step}/locate.json").read_text())
            out.update(locate_figures(report, f"step{step}"))
        return out
    if job == "smollm2-locate":
        report = json.loads((ROOT / "bench/results/locate-cpu-emulation/smollm2-step2/locate.json").read_text())
        return locate_figures(report, "smollm2")
    out = {}
    for kind, name in (("on", "algorithms-menu-cpu"), ("off", "algorithms-menu-cpu-offpolicy")):
        for variant, cells in mean_table((ROOT / f"bench/results/{name}.md").read_text(), "Mean over seeds:").items():
            out.update({f"{kind}:{variant}:{j}": cell for j, cell in enumerate(cells[:4])})
    return out


@pytest.mark.parametrize("job", ["locate", "smollm2-locate", "algorithms-menu"])
def test_the_committed_results_agree_with_the_pages_that_quote_them(job):
    fresh = _committed(job)
    for quote in (q for q in QUOTES if q.job == job):
        assert moved(quote, (ROOT / quote.doc).read_text(), fresh) == [], quote.doc


def test_make_demo_prints_its_figures_beside_the_readmes(tmp_path):
    import docs_numbers

    (tmp_path / "summary.txt").write_text(SUMMARY)
    readme = summary_figures(SUMMARY)
    quote = next(q for q in QUOTES if q.job == "demo" and q.doc == "README.md")
    quoted = {quote.key(g): v for g, v in quote.match((ROOT / "README.md").read_text()).groupdict().items()}
    text = docs_numbers.demo_compare(tmp_path)
    assert f"reward/mean {readme['reward_first']} -> {readme['reward_last']}" in text.splitlines()[0]
    assert f"reward/mean {quoted['reward_first']} -> {quoted['reward_last']}" in text.splitlines()[1]
    same = all(readme[k] == v for k, v in quoted.items())
    assert text.endswith("the same") == same
    (tmp_path / "summary.txt").write_text(SUMMARY.replace("0.324", "0.999"))
    assert "different" in docs_numbers.demo_compare(tmp_path)
