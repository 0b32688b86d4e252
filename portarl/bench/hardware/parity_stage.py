"""Stage 2: every op of every backend usable on the device, in every dtype, against float64;
and the hardware-marked tests.

The parity part is ``portarl parity`` (:func:`portarl.parity.sweep.run_sweep`) with the
hardware-sized cases on an accelerator, whose float64 references then run on the device
itself (:func:`portarl.parity.float64.computed_on`: the host would need minutes a case);
its report is ``parity.json``, the file ``portarl parity compare`` reads. The tests part
runs ``pytest -m gpu`` (``-m npu`` on Ascend): the device-generic test bodies instantiated
on the real device (``tests/conftest.py``). A skipped hardware test is listed with its
reason in the summary, never dropped silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from portarl.parity.float64 import computed_on
from portarl.parity.report import build_report, write_report
from portarl.parity.sweep import backends_for, run_sweep

DTYPES = ("fp32", "bf16", "fp16")
REPO = Path(__file__).resolve().parents[3]  # the project's tree: tests/ beside portarl/


def run(plan, device: torch.device, out, work, log) -> dict:
    from portarl.backends.envinfo import environment

    backends = backends_for(device)
    log(f"backends usable on {device}: {', '.join(backends)}; dtypes {', '.join(DTYPES)}"
        + ("; with the hardware-sized cases" if plan.parity_large else ""))
    where = device  # the float64 references beside the results: the device itself
    env = environment(device)
    env["float64_reference_device"] = str(where)
    records: list = []
    written = [time.monotonic()]

    def progress(line: str) -> None:  # the report so far, every 10 s: a stage stopped at its limit keeps it
        log(line)
        if time.monotonic() - written[0] > 10:
            write_report(build_report(device, records, {**env, "partial": True}), out / "parity.json")
            written[0] = time.monotonic()

    with computed_on(where):
        run_sweep(device, backends=backends, dtypes=DTYPES, include_hardware_cases=plan.parity_large,
                  repeats=plan.parity_repeats, progress=progress, sink=records)
    write_report(build_report(device, records, env), out / "parity.json")
    failed = [r for r in records if not r.passed]
    line = f"{len(records) - len(failed)}/{len(records)} checks within tolerance ({', '.join(backends)}; {', '.join(DTYPES)})"
    result = {"status": "ok" if not failed else "failed", "line": line, "backends": backends,
              "checks": len(records), "failed": [_describe(r) for r in failed[:20]]}
    if failed:
        result["line"] = f"{len(failed)} of {len(records)} parity checks out of tolerance, first: {_describe(failed[0])}"
    return result


def _describe(r) -> str:
    what = f"{r.backend} {r.dtype} {r.op} {r.case} {r.quantity}"
    if r.error:
        return f"{what}: {r.error[:200]}"
    return f"{what}: worst error {r.worst_ratio:.2f}x the tolerance ({r.nonfinite_mismatches} nan/inf mismatches)"


def hardware_tests(plan, device: torch.device, out, work, log) -> dict:
    """``pytest -m gpu`` / ``-m npu`` from the project's tree; on the CPU the marked tests all
    skip (no device), and the stage says so instead of passing."""
    tests = REPO / "tests"
    if not tests.is_dir():
        return {"status": "failed", "line": f"no tests/ beside the package ({REPO}): run from the project's tree"}
    marker = {"cuda": "gpu", "npu": "npu"}.get(device.type, "gpu or npu")
    junit = work / "hardware-tests.xml"
    workers = []
    if device.type != "cpu" and _has_xdist():  # the marked tests' Triton compiles are CPU work
        workers = ["-n", str(min(8, max(2, (os.cpu_count() or 2) // 2)))]
    cmd = [sys.executable, "-m", "pytest", "-v", *workers, "-m", marker, "-rs", "-p", "no:cacheprovider",
           "-p", "no:benchmark", f"--junitxml={junit}", str(tests)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # pytest's own deadline inside the stage's, so that what ran is counted even when it is stopped
    deadline = max(10.0, float(os.environ.get("PORTARL_STAGE_LIMIT_S", "600")) - 20)
    log("$ " + " ".join(cmd))
    progress = work / "hardware-tests.log"
    with progress.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    text_out = progress.read_text(errors="replace")
    for line in [x for x in text_out.splitlines() if " PASSED" not in x][-60:]:
        log(line)
    if rc is not None and junit.exists():
        counts, skipped, failures = read_junit(junit)
    else:
        counts, skipped, failures = read_verbose(text_out)
    ran = counts["passed"] + counts["failed"]
    text = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
            f"(pytest -m \"{marker}\", " + (f"exit {rc})" if rc is not None else f"stopped at its {deadline:.0f} s)"))
    result = {"counts": counts, "skipped": skipped, "failures": failures[:20], "line": text}
    if rc is None:
        result["status"] = "failed"
        result["line"] = f"stopped at {deadline:.0f} s after {text}" + (f"; first failure: {failures[0]}" if failures else "")
    elif counts["failed"] or rc not in (0, 5) or not junit.exists():
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
