"""``portarl hardware-check``: run the stages, each in a child process with a time limit, and
leave one folder a person reads.

The output folder holds at most :data:`MAX_FILES` files (the lent GPU machine returns no
more), all of them flat:

=================  ==========================================================================
``summary.md``     read first: each stage's one line, the figures, what failed and why
``check.json``     the same, for programs: stage outcomes, times, the plan
``check.log``      every stage's progress lines and the tail of anything that failed
``envinfo.json``   device, memory, versions, copy bandwidth, matmul throughput
``parity.json``    the parity report (``portarl parity compare`` reads it)
``kernels.json``   the kernel timings (``kernels.md``: the same as a table)
``stability.tar``  the stability record (``portarl bench stability compare`` / ``--replay-from``)
=================  ==========================================================================

Exit status: 0 when every stage ran and passed (``n/a`` for a stage that cannot apply, the
hardware tests on a CPU, is not a failure); 1 when a stage failed, ran past its limit or
could not start, with one line on stderr naming the first; 2 for bad usage. A stage is
never skipped silently: each one is in the summary with its outcome.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from portarl.bench.hardware.plan import STAGES, CheckPlan

MAX_FILES = 8
OUTPUT_FILES = ("summary.md", "check.json", "check.log", "envinfo.json", "parity.json", "kernels.json", "kernels.md",
                "stability.tar")
STAGE_MODULES = {
    "environment": ("portarl.bench.hardware.environment", "run"),
    "parity": ("portarl.bench.hardware.parity_stage", "run"),
    "kernels": ("portarl.bench.hardware.kernels_stage", "run"),
    "training": ("portarl.bench.hardware.training_stage", "run"),
    "step": ("portarl.bench.hardware.step_stage", "run"),
    "hardware-tests": ("portarl.bench.hardware.tests_stage", "hardware_tests"),
}


def write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def run_check(plan: CheckPlan, out: Path, *, stages=STAGES, work: Path | None = None,
              say=lambda line: print(line, flush=True)) -> int:
    """Every stage of ``stages`` in order; returns the exit status."""
    out.mkdir(parents=True, exist_ok=True)
    stray = [p.name for p in out.iterdir() if p.name not in OUTPUT_FILES]
    if stray:
        raise FileExistsError(f"--out {out} holds other files ({', '.join(sorted(stray)[:5])}): give an empty or "
                              "new folder (the folder travels back from a lent machine whole, 8 files at most)")
    if work is None:  # scratch (the stability runs, the FSDP2 run, pytest's XML) outside the folder that travels
        with tempfile.TemporaryDirectory(prefix="portarl-hardware-check-") as scratch:
            return run_check(plan, out, stages=stages, work=Path(scratch), say=say)
    work.mkdir(parents=True, exist_ok=True)
    (work / "plan.json").write_text(plan.to_json())
    log_path = out / "check.log"
    log_path.write_text("")
    started = time.monotonic()
    outcomes: dict[str, dict] = {}
    for name in stages:
        left = plan.total_s - (time.monotonic() - started)
        limit = min(plan.limits_s.get(name, 300), left)
        if left < 5:
            outcomes[name] = {"status": "failed", "line": f"not run: the check's {plan.total_s:.0f} s were spent"}
        else:
            say(f"[{name}] up to {limit:.0f} s")
            outcomes[name] = run_stage(name, work, out, limit, log_path, say)
        outcomes[name].setdefault("seconds", 0.0)
        say(f"[{name}] {outcomes[name]['status']} ({outcomes[name]['seconds']:.0f} s): {outcomes[name]['line']}")
        write_outputs(plan, out, outcomes, time.monotonic() - started)
    failed = [(n, o) for n, o in outcomes.items() if o["status"] not in ("ok", "n/a")]
    extra = sorted(p.name for p in out.iterdir() if p.name not in OUTPUT_FILES)
    if extra:  # a stage wrote what the folder's contract (OUTPUT_FILES, at most MAX_FILES) does not hold
        failed.append(("output", {"line": f"the folder holds files outside its contract: {', '.join(extra)}"}))
    if failed:
        name, o = failed[0]
        print(f"portarl hardware-check: {name} failed: {o['line']} (summary: {out / 'summary.md'})", file=sys.stderr)
        return 1
    say(f"hardware-check passed: {out / 'summary.md'}")
    return 0


def run_stage(name: str, work: Path, out: Path, limit: float, log_path: Path, say) -> dict:
    """One stage in a child process (``python -m portarl.bench.hardware.stage``), its output
    appended to ``check.log`` as it comes; stopped at ``limit`` seconds."""
    result_path = work / f"{name}.result.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "portarl.bench.hardware.stage", name, str(work / "plan.json"), str(out), str(work)]
    started = time.monotonic()
    with log_path.open("a") as log:
        log.write(f"\n===== {name} =====\n")
        log.flush()
        env = dict(os.environ, PORTARL_STAGE_LIMIT_S=f"{limit:.0f}")  # a stage with a child of its own stops it first
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc = None
        except BaseException:  # Ctrl-C / SIGTERM of the check: the stage (a session of its own) goes too
            _stop(proc)
            raise
    seconds = time.monotonic() - started
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if rc is None:
            result["status"] = "failed"
            result["line"] = f"stopped at its {limit:.0f} s limit after: {result.get('line', '')}"
    elif rc is None:
        result = {"status": "failed", "line": f"ran past its {limit:.0f} s limit and was stopped ({_last_line(log_path)})"}
    else:
        result = {"status": "failed", "line": f"its process exited {rc} without a result: {_last_line(log_path)}"}
    result["seconds"] = seconds
    return result


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group (its own children too: torchrun, the stability
    workers, pytest), then SIGKILL after 10 s; always waited for."""
    import signal

    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def _last_line(log_path: Path) -> str:
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:240] if lines else "no output"


def write_outputs(plan: CheckPlan, out: Path, outcomes: dict, seconds: float) -> None:
    from portarl.bench.hardware.summary import summary_markdown

    write_json(out / "check.json", {"plan": json.loads(plan.to_json()), "seconds": seconds, "stages": outcomes})
    (out / "summary.md").write_text(summary_markdown(plan, out, outcomes, seconds))
