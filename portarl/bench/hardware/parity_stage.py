"""Stage 2: every op of every backend usable on the device, in every dtype, against float64.

It is ``portarl parity`` (:func:`portarl.parity.sweep.run_sweep`) with the
hardware-sized cases on an accelerator, whose float64 references then run on a GPU itself
(:func:`portarl.parity.float64.reference_device_for`: the host would need minutes a case;
an NPU's stay on the host: float64 on Ascend is slow or missing);
its report is ``parity.json``, the file ``portarl parity compare`` reads. The hardware-marked
tests are the last stage (:mod:`.tests_stage`).
"""

from __future__ import annotations

import time

import torch

from portarl.parity.float64 import computed_on, reference_device_for
from portarl.parity.report import build_report, write_report
from portarl.parity.sweep import backends_for, run_sweep

DTYPES = ("fp32", "bf16", "fp16")


def run(plan, device: torch.device, out, work, log) -> dict:
    from portarl.backends.envinfo import environment

    backends = backends_for(device)
    log(f"backends usable on {device}: {', '.join(backends)}; dtypes {', '.join(DTYPES)}"
        + ("; with the hardware-sized cases" if plan.parity_large else ""))
    where = reference_device_for(device)  # a GPU itself; the CPU beside an NPU (no fast float64)
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
