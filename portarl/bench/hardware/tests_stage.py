"""Stage 5: the hardware-marked tests, ``pytest -m gpu`` (``-m npu`` on Ascend): the
device-generic test bodies instantiated on the real device (``tests/conftest.py``).

Two pytest runs side by side, each ``-v`` (a run stopped at the stage's deadline is counted
from its lines) with a JUnit file (skip reasons):

- ``parallel``: every marked test but the hardware-sized ones, in several pytest-xdist
  workers when xdist is there (the marked tests' Triton compiles are CPU work);
- ``hardware-sized``: the tests marked ``hardware_sized`` (600 M-element cases with their
  float64 references), one at a time in one process. Several at once ran the H200 loan's
  host out of memory in its 8- and 14-worker runs (2 and 11 failures near the end, where
  they sit). xdist's ``--dist loadgroup`` would group them, but it silently stopped
  grouping on pytest 9.2 (pytest-xdist issue #1386).

On the CPU the marked tests all skip (no device), and the stage says so instead of passing.
A skipped hardware test is listed with its reason in the summary, never dropped silently.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]  # the project's tree: tests/ beside portarl/


@dataclasses.dataclass
class PytestRun:
    name: str
    select: str  # the -m expression
    argv: list
    junit: Path
    log: Path


def hardware_tests_runs(device: torch.device, work: Path) -> list[PytestRun]:
    """The stage's pytest runs (see the module docstring); on the CPU, or without xdist,
    one run of every marked test."""
    marker = _marker(device)
    tests = str(REPO / "tests")

    def run(name: str, select: str, *extra: str) -> PytestRun:
        junit, log = work / f"hardware-tests-{name}.xml", work / f"hardware-tests-{name}.log"
        argv = [sys.executable, "-m", "pytest", "-v", *extra, "-m", select, "-rs", "-p", "no:cacheprovider",
                "-p", "no:benchmark", f"--junitxml={junit}", tests]
        return PytestRun(name, select, argv, junit, log)

    if device.type == "cpu" or not _has_xdist():
        return [run("all", marker)]
    workers = str(min(8, max(2, (os.cpu_count() or 2) // 2)))
    return [run("parallel", f"({marker}) and not hardware_sized", "-n", workers),
            run("hardware-sized", f"({marker}) and hardware_sized")]


def hardware_tests(plan, device: torch.device, out, work, log) -> dict:
    tests = REPO / "tests"
    if not tests.is_dir():
        return {"status": "failed", "line": f"no tests/ beside the package ({REPO}): run from the project's tree"}
    marker = _marker(device)
    runs = hardware_tests_runs(device, Path(work))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # pytest's own deadline inside the stage's, so that what ran is counted even when it is stopped
    deadline = max(10.0, float(os.environ.get("PORTARL_STAGE_LIMIT_S", "600")) - 20)
    codes = _run_all(runs, env, deadline, log)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    skipped: dict[str, int] = {}
    failures: list[str] = []
    for run, rc in zip(runs, codes):
        text_out = run.log.read_text(errors="replace")
        for line in [x for x in text_out.splitlines() if " PASSED" not in x][-60:]:
            log(f"[{run.name}] {line}")
        run_counts, run_skipped, run_failures = (read_junit(run.junit) if rc is not None and run.junit.exists()
                                                 else read_verbose(text_out))
        for key in counts:
            counts[key] += run_counts[key]
        for reason, n in run_skipped.items():
            skipped[reason] = skipped.get(reason, 0) + n
        failures += run_failures
    stopped = any(rc is None for rc in codes)
    ran = counts["passed"] + counts["failed"]
    exits = ", ".join(f"{r.name} " + (f"exit {rc}" if rc is not None else f"stopped at its {deadline:.0f} s")
                      for r, rc in zip(runs, codes))
    text = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
            f"(pytest -m \"{marker}\": {exits})")
    result = {"counts": counts, "skipped": skipped, "failures": failures[:20], "line": text}
    if stopped:
        result["status"] = "failed"
        result["line"] = f"stopped at {deadline:.0f} s after {text}" + (f"; first failure: {failures[0]}" if failures else "")
    elif counts["failed"] or any(rc not in (0, 5) for rc in codes) or not all(r.junit.exists() for r in runs):
        result["status"] = "failed"
        if failures:
            result["line"] = f"{counts['failed']} hardware tests failed, first: {failures[0]}"
    elif device.type == "cpu":
        result["status"] = "n/a"
        result["line"] = f"no GPU or NPU here: {counts['skipped']} hardware tests skipped, none ran"
    elif ran == 0:
        result["status"] = "failed"
        result["line"] = f"no hardware test ran on {device}: {counts['skipped']} skipped ({_first(skipped)})"
    else:
        result["status"] = "ok"
    return result


def _run_all(runs: list[PytestRun], env: dict, deadline: float, log) -> list[int | None]:
    """Start every run, wait for all until ``deadline`` seconds; a run still going then is
    killed with its process group (its workers) and its code is None. Every process started
    is waited for on every path."""
    procs = []
    try:
        for run in runs:
            log("$ " + " ".join(run.argv))
            with run.log.open("w") as sink:
                procs.append(subprocess.Popen(run.argv, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        end = time.monotonic() + deadline
        codes: list[int | None] = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:  # it ended between the two calls
                    pass
            proc.wait()


def _marker(device: torch.device) -> str:
    return {"cuda": "gpu", "npu": "npu"}.get(device.type, "gpu or npu")


def _has_xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


def _first(skipped: dict) -> str:
    return next(iter(skipped), "no reason given")


VERBOSE = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b.*?(tests/\S+::\S+)|(tests/\S+::\S+).*?\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def read_verbose(text: str) -> tuple[dict, dict, list[str]]:
    """Counts and failed test ids from ``pytest -v`` output (with or without xdist), for a run
    stopped before it wrote its JUnit file."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures: list[str] = []
    seen = set()
    for line in text.splitlines():
        m = VERBOSE.search(line)
        if not m:
            continue
        status, name = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        if (name, status) in seen:
            continue
        seen.add((name, status))
        if status in ("PASSED", "XFAIL", "XPASS"):
            counts["passed"] += 1
        elif status == "SKIPPED":
            counts["skipped"] += 1
        else:
            counts["failed"] += 1
            failures.append(name)
    return counts, {}, failures


def read_junit(path: Path) -> tuple[dict, dict, list[str]]:
    """Counts, skip reasons (reason -> how many) and failed test ids of a JUnit XML file."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    skipped: dict[str, int] = {}
    failures: list[str] = []
    if not path.exists():
        return counts, skipped, failures
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        skip = case.find("skipped")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if skip is not None:
            counts["skipped"] += 1
            reason = (skip.get("message") or "").strip()[:160]
            skipped[reason] = skipped.get(reason, 0) + 1
        elif bad is not None:
            counts["failed"] += 1
            failures.append(f"{name}: {(bad.get('message') or '').strip().splitlines()[0][:200] if bad.get('message') else ''}")
        else:
            counts["passed"] += 1
    return counts, skipped, failures
