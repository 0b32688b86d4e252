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
import subprocess
import sys
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
    where = device if device.type != "cpu" else torch.device("cpu")
    with computed_on(where):
        records = run_sweep(device, backends=backends, dtypes=DTYPES, include_hardware_cases=plan.parity_large,
                            repeats=plan.parity_repeats, progress=log)
    env = environment(device)
    env["float64_reference_device"] = str(where)
    report = build_report(device, records, env)
    write_report(report, out / "parity.json")
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
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", marker, "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}",
           str(tests)]
    if device.type != "cpu" and _has_xdist():
        cmd[4:4] = ["-n", "4"]  # a device shared by 4 workers: the marked tests are small, their Triton compiles are not
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines()[-60:]:
        log(line)
    counts, skipped, failures = read_junit(junit)
    ran = counts["passed"] + counts["failed"]
    text = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
            f"(pytest -m \"{marker}\", exit {proc.returncode})")
    result = {"counts": counts, "skipped": skipped, "failures": failures[:20], "line": text}
    if counts["failed"] or proc.returncode not in (0, 5) or not junit.exists():
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
