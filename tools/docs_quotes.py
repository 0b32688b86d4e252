"""The numbers the docs quote from commands, and how to find them in the pages
(:mod:`docs_numbers` re-runs the commands): pure text handling, no torch, so the unit test
(``tests/test_docs_numbers.py``) is fast and ``make demo`` can compare its figures at once.

A :class:`Quote` is a page, a pattern whose named groups are the quoted numbers, and the job
whose output fills them. Values are strings as the page prints them (the precision is the
page's), compared exactly; only line breaks and repeated spaces inside a quote are ignored.
"""

from __future__ import annotations

import dataclasses
import re

NUM = r"[0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?"


@dataclasses.dataclass(frozen=True)
class Quote:
    """Numbers quoted in ``doc``: ``pattern``'s named groups, filled from ``job``'s values
    (a group's value key is its name, or ``keys[name]``)."""
    doc: str
    pattern: str
    job: str
    keys: tuple[tuple[str, str], ...] = ()

    def match(self, text: str) -> re.Match:
        found = re.search(self.pattern, text, flags=re.S)
        if found is None:
            raise LookupError(f"{self.doc}: the quote {self.pattern[:70]!r}... is not in the page any more: "
                              "fix the page or the pattern in tools/docs_numbers.py")
        return found

    def key(self, group: str) -> str:
        return dict(self.keys).get(group, group)


def _same(quoted: str, fresh: str) -> bool:
    """Equal as printed: exact, except that line breaks and runs of spaces (a quote wrapped
    over lines of a page) count as one space."""
    return " ".join(quoted.split()) == " ".join(fresh.split())


def moved(quote: Quote, text: str, fresh: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(value key, quoted, fresh)`` for every group whose quoted text differs from the fresh
    value (a value the job did not produce counts as moved: its output changed shape)."""
    found = quote.match(text)
    out = []
    for group, quoted in found.groupdict().items():
        new = fresh.get(quote.key(group), "<missing from the job's output>")
        if not _same(quoted, new):
            out.append((quote.key(group), quoted, new))
    return out


def rewrite(quote: Quote, text: str, fresh: dict[str, str]) -> str:
    """``text`` with each of the quote's groups replaced by its fresh value."""
    found = quote.match(text)
    for group in sorted(found.groupdict(), key=lambda g: found.start(g), reverse=True):
        if _same(found.group(group), fresh[quote.key(group)]):
            continue  # keep the page's own line breaks
        text = text[: found.start(group)] + fresh[quote.key(group)] + text[found.end(group):]
    return text


# ------------------------------------------------------------------ reading outputs
def summary_figures(summary: str) -> dict[str, str]:
    """The figures of a run's ``summary.txt`` (as ``portarl train`` prints them at its end)."""
    out = {}
    for name, label in (("reward", "reward/mean"), ("accuracy", "accuracy")):
        m = re.search(rf"^{re.escape(label)}\s+first 10 steps: ({NUM})\s+last 10 steps: ({NUM})", summary, flags=re.M)
        if m is None:
            raise ValueError(f"summary.txt has no {label!r} line:\n{summary}")
        out[f"{name}_first"], out[f"{name}_last"] = m.groups()
    m = re.search(r"spikes: (\d+)", summary)
    out["spikes"] = m.group(1) if m else "?"
    return out


def half_up(value: float, places: int = 2) -> str:
    """``value`` as the pages print a per-step reward (0.125 -> "0.13", 0.625 -> "0.63"):
    rounded half up, where Python's format rounds the binary value (0.125 -> "0.12")."""
    from decimal import ROUND_HALF_UP, Decimal

    return str(Decimal(repr(value)).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))


def makefile_demo(makefile: str) -> tuple[str, list[str]]:
    """``(DEMO_THREADS, DEMO_SETS as arguments)`` as the Makefile defines them."""
    threads = re.search(r"^DEMO_THREADS \?= *(\S+)", makefile, flags=re.M)
    sets = re.search(r"^DEMO_SETS \?= *(.+)$", makefile, flags=re.M)
    if threads is None or sets is None:
        raise LookupError("the Makefile defines no DEMO_THREADS / DEMO_SETS")
    return threads.group(1), sets.group(1).split()


def locate_figures(report: dict, prefix: str) -> dict[str, str]:
    """Figures of a ``locate.json`` as the pages quote them: the verdict's amplification and
    errors, the closest call's share of the explained error, and per-op cosine / errors."""
    out = {}
    m = re.search(rf"\(forward\), ({NUM})x its input's error \(({NUM}) -> ({NUM});", report["verdict"])
    if m:
        out[f"{prefix}_amp"], out[f"{prefix}_in"], out[f"{prefix}_out"] = m.groups()
    m = re.search(rf"closest: \S+ \(forward\), out err {NUM} = ({NUM}) of", report["verdict"])
    if m:
        out[f"{prefix}_closest"] = m.group(1)
    forward = {r["module"]: r for r in report["rows"] if r["direction"] == "forward" and not r["call"]}
    if "portarl.kl" in forward and forward["portarl.kl"]["cos"] is not None:
        out[f"{prefix}_kl_cos"] = f"{forward['portarl.kl']['cos']:.2f}"
    if "portarl.logprobs" in forward:
        out[f"{prefix}_logp_pct"] = f"{100 * forward['portarl.logprobs']['out_err']:.0f}"
    out[f"{prefix}_pairs"] = str(len(report["rows"]))
    return out


def mean_table(markdown: str, title: str) -> dict[str, list[str]]:
    """The table right after the line ``title``: its first column -> the other cells."""
    block = markdown.split(title, 1)[1].strip().splitlines()
    rows = []
    for line in block:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return {row[0]: row[1:] for row in rows[2:]}


# ------------------------------------------------------------------ the registry
def _table_quotes(doc: str, title: str, kind: str, rows: dict[str, str]) -> list[Quote]:
    """One quote per row of a mean table in ``doc`` (its four numeric cells), the row found
    by its label after ``title``; ``rows``: page label -> the bench's variant name."""
    out = []
    for label, variant in rows.items():
        cells = r" \| ".join(rf"(?P<c{j}>{NUM})\*?" for j in range(4))
        keys = tuple((f"c{j}", f"{kind}:{variant}:{j}") for j in range(4))
        out.append(Quote(doc, rf"{re.escape(title)}.*?\n\| {re.escape(label)} \| {cells} \|", "algorithms-menu", keys))
    return out


DEMO_KEYS = (("a", "reward_first"), ("b", "reward_last"), ("c", "accuracy_first"), ("d", "accuracy_last"))

QUOTES: list[Quote] = [
    # the demo (make demo): README's Quickstart and the getting-started table
    Quote("README.md", rf"The reward rises from (?P<a>{NUM}) to (?P<b>{NUM}) and the accuracy from (?P<c>{NUM}) to "
          rf"(?P<d>{NUM})", "demo", DEMO_KEYS),
    Quote("docs/getting-started.md", rf"\| reward/mean, first -> last 10 GRPO steps \| (?P<a>{NUM}) -> (?P<b>{NUM})"
          rf".*?\| accuracy \(`math_exact`\), first -> last 10 \| (?P<c>{NUM}) -> (?P<d>{NUM}) \|"
          r".*?\| spikes, identical-samples warnings \| (?P<spikes>\d+), (?P<identical>\d+) \|", "demo", DEMO_KEYS),
    # docs/agents.md's one-minute recipe (examples/agents-tiny.yaml), its summary quoted whole
    Quote("docs/agents.md", r"```text\n(?P<agents_summary>steps logged: .*?)\n```", "agents-tiny"),
    # portarl plan, quoted whole
    Quote("docs/memory.md", r"\$ portarl plan --config bench/configs/smollm2-readme\.yaml --device-memory 8GiB\n"
          r"(?P<plan>.*?)\n```", "plan"),
    Quote("docs/memory.md", r"portarl train: memory plan: estimated peak (?P<plan_peak>\S+ \S+) per device", "plan"),
    # bench/results/locate-cpu-emulation (tiny: steps 1 and 9; SmolLM2: step 2)
    Quote("bench/results/locate-cpu-emulation/README.md", rf"`portarl\.loss`, (?P<step1_amp>{NUM})x its input's error "
          rf"\((?P<step1_in>{NUM}) -> (?P<step1_out>{NUM})\)", "locate"),
    Quote("bench/results/locate-cpu-emulation/README.md", r"log-probs differ by (?P<step9_logp_pct>\d+)% relative.*?"
          rf"\(cosine (?P<step9_kl_cos>{NUM}) between the two\s+sides' per-token KL, (?P<step9_closest>{NUM}) of",
          "locate"),
    Quote("docs/locate.md", rf"`portarl\.loss`, (?P<step1_amp>{NUM})x its\s+input's error \((?P<step1_in>{NUM}) -> "
          rf"(?P<step1_out>{NUM})\)", "locate"),
    Quote("docs/locate.md", r"\(log-probs (?P<step9_logp_pct>\d+)% apart\);\s+nothing beyond what those inputs "
          rf"explain, the closest being `portarl\.kl` \(cosine (?P<step9_kl_cos>{NUM})\)", "locate"),
    Quote("bench/results/locate-cpu-emulation/README.md", r"(?P<smollm2_pairs>\d+) paired calls.*?First amplification: "
          rf"`portarl\.kl`, (?P<smollm2_amp>{NUM})x its input's error \(log-probs (?P<smollm2_in>{NUM}) apart",
          "smollm2-locate"),
    Quote("docs/locate.md", r"\(`smollm2-step2/`, (?P<smollm2_pairs>\d+) paired\s+calls.*?first amplification "
          rf"`portarl\.kl`, (?P<smollm2_amp>{NUM})x", "smollm2-locate"),
    # examples/smollm2-arith.yaml: README and Models and data
    Quote("README.md", rf"SmolLM2-135M-Instruct, accuracy (?P<before_acc2>{NUM}) -> (?P<after_acc2>{NUM}) in 16 steps",
          "smollm2-example"),
    Quote("docs/models-and-data.md", rf"\| SmolLM2-135M-Instruct as shipped \| (?P<before_acc>{NUM}) "
          rf"\((?P<before_right>\d+ / \d+)\) \| (?P<before_finished>{NUM}) \|\n\| after the 16 GRPO steps of the "
          rf"example \| \*\*(?P<after_acc>{NUM})\*\* \((?P<after_right>\d+ / \d+)\) \| (?P<after_finished>{NUM}) \|",
          "smollm2-example"),
    Quote("docs/models-and-data.md", r"`reward/math_exact` per step went (?P<steps>[0-9., \n]+?) \(16 samples each; "
          rf"mean (?P<mean_first>{NUM}) over the first ten\s+steps, (?P<mean_last>{NUM}) over the last ten\)",
          "smollm2-example"),
    # docs/algorithms-menu.md: the two mean tables
    *_table_quotes("docs/algorithms-menu.md", "**On-policy", "on", {
        "ppo_clip (default)": "ppo_clip (default)", "cispo": "cispo", "sapo": "sapo",
        "dynamic sampling (ppo_clip)": "dynamic sampling"}),
    *_table_quotes("docs/algorithms-menu.md", "**Off-policy", "off", {
        "ppo_clip (default)": "ppo_clip (default)", "cispo (`cispo_ratio_max` 5)": "cispo",
        "cispo, `cispo_ratio_max` 1.28": "cispo ratio_max 1.28", "sapo (`tau` 1 / 1.05)": "sapo",
        "sapo, `tau` 4 / 8": "sapo tau 4/8", "dynamic sampling (ppo_clip)": "dynamic sampling"}),
]

#: What the docs quote that no job re-runs, and why.
NOT_COVERED = [
    ("timings (wall / CPU time anywhere: getting-started's demo rows, bench step / async / kernels / memory "
     "results, SmolLM2 step times)", "they depend on the machine's load: measured by hand, with the load stated"),
    ("memory peaks (RSS in docs/memory.md, models-and-data.md, benchmarks)",
     "they depend on the allocator and the load (docs/memory.md gives the commands)"),
    ("GPU and Ascend NPU numbers (hardware-ci.md, kernels-and-parity.md, stability.md)", "no accelerator here"),
    ("bench/results/stability-* (the recordings and compare reports)",
     "their recorded rollouts are the input of the locate reports: re-recording is a deliberate act"),
    ("docs/async.md's SmolLM2 2-rank bf16 run and bench async tables", "timings, and a 2-rank SmolLM2 job"),
    ("prose that restates a table (algorithms-menu.md's per-seed figures and rounds per step)",
     "reread after a --write that changed the tables"),
]
