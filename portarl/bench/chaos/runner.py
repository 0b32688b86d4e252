"""The chaos run's supervising loop (``portarl bench chaos``).

1. The uninterrupted run: the mode's command once, to the end (exit 0 required).
2. The chaos run: the same command with ``--resume-or-start``, started again after every exit
   until it exits 0 at the last step, while the schedule's faults are injected in order.
   After each exit: its code and the last line it printed (a fault that ends the job without
   a line is a finding), the job's processes given :data:`SETTLE_S` to end (one still alive
   after that is an orphan: a finding, and it is killed), the run's lock free (a finding if
   not).
3. The comparison (:mod:`.compare`) and ``chaos.json``: the seed, the schedule, every
   injection, every launch, the findings, the time lost.

This process is the job's subreaper while it runs (a rank's orphans come back to it, so
none escapes the count), and it stops and joins everything it started on every exit path.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from portarl.bench.chaos import compare, inject
from portarl.bench.chaos.judge import ChaosJudge
from portarl.bench.chaos.modes import MODES, base_sets, command
from portarl.bench.chaos.schedule import make_schedule
from portarl.runtime import process_tree
from portarl.trainer.run.write_failure import CHAOS_DIR_ENV

#: Seconds a finished job's processes get to end before one still alive counts as an orphan
#: (a rank or worker tearing down after the job's top process exited takes a second or two
#: on an idle machine; 60 s leaves a loaded CI machine room).
SETTLE_S = 60.0
#: Poll interval of the loop (reading metrics.jsonl's size, the process tree).
POLL_S = 0.05


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _stop(signum, frame):
    """SIGTERM of the chaos run itself: unwind, so the job it runs is killed on the way out."""
    raise KeyboardInterrupt(f"chaos run stopped by {signal.Signals(signum).name}")


def _lock_free(run: Path) -> bool:
    path = run / ".portarl.lock"
    if not path.exists():
        return True
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
    return True


def _max_staleness(run: Path) -> int:
    from portarl.trainer.config import TrainConfig

    return TrainConfig.load(str(run / "config.yaml"), []).rollout.max_staleness


#: A line portarl's command prints (torchrun's own "portarl FAILED" summary is not one).
_NAMED = re.compile(r"^portarl [a-z]+: ")


def _named_lines(path: Path) -> list[str]:
    """The launch's own words on how it ended: its ``portarl ...:`` lines after start-up."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [ln[:400] for ln in lines if _NAMED.match(ln) and "memory plan:" not in ln and " model on " not in ln]


def _why(lines: list[str]) -> str:
    """The line that names why a launch ended (not the parent's note on how it went out)."""
    return next((ln for ln in reversed(lines) if "on its way out" not in ln), lines[-1] if lines else "")


def _settle(before: set[int]) -> list[int]:
    """Wait for the job's leftover processes (children of ours now, as subreaper, that were
    not ours before the launch); kill and reap those alive after :data:`SETTLE_S`."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        left = [pid for pid in process_tree.children(os.getpid()) - before
                if (st := process_tree.stat(pid)) is not None and st.state != "Z"]
        for pid in process_tree.children(os.getpid()) - before:  # reap the zombies among them
            st = process_tree.stat(pid)
            if st is not None and st.state == "Z":
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if left:
        process_tree.end_tree(left)
    return left


def _launch(cmd, env, log_path: Path):
    log = log_path.open("w")
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log
    except BaseException:
        log.close()
        raise


class _Progress:
    """The step a launch has logged: the last row of ``metrics.jsonl`` once the file changed
    after the launch began (None before: start-up, or a resume that has not logged yet)."""

    def __init__(self, run: Path):
        self.path = run / "metrics.jsonl"
        self.start = self._stamp()

    def _stamp(self):
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime_ns

    def step(self) -> int | None:
        if self._stamp() == self.start:
            return None
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            return None
        for line in reversed(lines):
            try:
                row = json.loads(line)
            except ValueError:  # a row being written
                continue
            if "step" in row:
                return int(row["step"])
        return None


def _reference(mode, reference: Path, sets, env, steps: int) -> dict:
    """The uninterrupted run, timed: its start-up (launch to the first logged step) and its
    seconds per step, which scale the faults' delays."""
    t0 = time.monotonic()
    proc = subprocess.Popen(command(mode, reference, sets, resume=False), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    first = None
    try:
        watch = _Progress(reference)
        while proc.poll() is None and first is None:
            first = time.monotonic() if watch.step() is not None else None
            time.sleep(POLL_S)
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:  # stopped from outside: the whole job, not its top process only
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    total = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the uninterrupted {mode.name} run failed (exit {proc.returncode}): {out[-3000:]}")
    first = first or time.monotonic()
    return {"uninterrupted_s": round(total, 2), "start_up_s": round(first - t0, 2),
            "step_s": round(max(total - (first - t0), 0.01) / max(steps - 1, 1), 3)}


def _requeue(unconsumed: list[str], injected: list, pending: list, report: dict, launch: int) -> None:
    """Faults armed in a file that no write or reward reached before the launch ended go back
    to the head of the queue: one per file left, the last to arm it (two faults of a kind armed
    in one launch share the file; requeueing both made each launch arm it twice, forever)."""
    for name in unconsumed:
        fault = next(f for f in reversed(injected) if inject.ARMED.get(f.kind) == name)
        pending.insert(0, fault)
        report["injections"] = [i for i in report["injections"]
                                if not (i["fault"] == fault.index and i["launch"] == launch)]


def _due(pending: list, launch_start_step: int, logged: int | None):
    """The fault to inject next in this launch, or None: the first start-up fault whose step
    this launch started at or after (before it logs a step), else the first in-run fault."""
    if logged is None:
        for fault in pending:
            if fault.start_up and fault.after_step <= launch_start_step:
                return fault
        return None
    return next((f for f in pending if not f.start_up and logged >= f.after_step), None)


def run_chaos(mode_name: str, *, steps: int, faults: int, seed: int, work_dir: Path, checkpoint_every: int = 2,
              progress=print) -> dict:
    """One chaos run of ``mode_name`` and its uninterrupted twin under ``work_dir``; the
    report (also written to ``work_dir/chaos.json``)."""
    if mode_name not in MODES:
        raise ValueError(f"mode {mode_name!r}: choose from {', '.join(MODES)}")
    mode = MODES[mode_name]
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    chaos_dir = work_dir / "faults"
    chaos_dir.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", CHAOS_DIR_ENV: str(chaos_dir)}
    env.pop("TRITON_INTERPRET", None)
    schedule = make_schedule(seed, faults, steps, list(mode.kinds))
    report = {"mode": mode.name, "guarantee": mode.guarantee, "seed": seed, "steps": steps, "faults": faults,
              "schedule": [f.as_json() for f in schedule], "injections": [], "launches": [], "findings": []}
    was_reaper = process_tree.set_subreaper(True)
    procs: list = []
    previous = signal.signal(signal.SIGTERM, _stop) if _main_thread() else None
    try:
        with ChaosJudge() as judge:
            sets = base_sets(steps, checkpoint_every, judge.url)
            reference, run = work_dir / "uninterrupted", work_dir / "chaos"
            progress(f"chaos {mode.name}: the uninterrupted run ({steps} steps)")
            report.update(_reference(mode, reference, sets, env, steps))
            progress(f"chaos {mode.name}: {report['uninterrupted_s']} s (start-up {report['start_up_s']} s, "
                     f"{report['step_s']} s a step); the chaos run, {faults} faults, seed {seed}")
            pending = list(schedule)
            t_chaos = time.monotonic()
            while True:
                if len(report["launches"]) > 3 * faults + 10:
                    report["findings"].append("the run did not finish after 3 launches per fault: stopped")
                    break
                n = len(report["launches"]) + 1
                before = process_tree.children(os.getpid())
                start_step = max(compare.step_rows(run), default=0)
                watch = _Progress(run)
                proc, log = _launch(command(mode, run, sets, resume=True), env, work_dir / f"launch-{n}.log")
                procs.append((proc, log))
                started, due_since, injected = time.monotonic(), None, []
                while proc.poll() is None:
                    logged = watch.step()
                    fault = _due(pending, start_step, logged)
                    if fault is None:
                        due_since = None
                    else:
                        due_since = due_since or (started if logged is None else time.monotonic())
                        wait = fault.delay * (report["start_up_s"] if fault.start_up else report["step_s"])
                        if time.monotonic() - due_since >= wait:
                            what = inject.inject(fault, proc.pid, chaos_dir, judge)
                            if what is not None:
                                pending.remove(fault)
                                injected.append(fault)
                                due_since = None
                                where = "start-up" if logged is None else f"step {logged}"
                                report["injections"].append({"fault": fault.index, "kind": fault.kind, "launch": n,
                                                             "at": where, **what})
                                progress(f"  launch {n}, {where}: {fault.kind} {what}")
                    time.sleep(POLL_S)
                log.close()
                code = proc.returncode
                leftovers = _settle(before)
                unconsumed = inject.disarm(chaos_dir)
                _requeue(unconsumed, injected, pending, report, n)
                end_step = max(compare.step_rows(run), default=0)
                said = _named_lines(work_dir / f"launch-{n}.log")
                launch = {"launch": n, "exit": code, "from_step": start_step, "to_step": end_step,
                          "seconds": round(time.monotonic() - started, 2), "line": _why(said),
                          "worker_side": any("rollout worker" in line for line in said)}
                if unconsumed:
                    launch["unconsumed"] = unconsumed
                report["launches"].append(launch)
                progress(f"  launch {n}: steps {start_step}->{end_step}, exit {code}: {launch['line'][:200]}")
                if leftovers:
                    report["findings"].append(f"launch {n}: processes left behind after {SETTLE_S:.0f} s: {leftovers}")
                if not _lock_free(run):
                    report["findings"].append(f"launch {n}: the run's lock is still held after it ended")
                if code not in (0, None) and not said:
                    report["findings"].append(f"launch {n}: exit {code} without a line naming why")
                if code == 0:
                    if end_step != steps:
                        report["findings"].append(f"launch {n}: exit 0 at step {end_step} of {steps}")
                    break
            report["not_injected"] = [f.as_json() for f in pending]
            report["chaos_s"] = round(time.monotonic() - t_chaos, 2)
            report["time_lost_s"] = round(report["chaos_s"] - report["uninterrupted_s"], 2)
            # async: a stop the rollout worker caused (killed, a reward or the judge failing in it)
            # resumes by design from the checkpoint's weights (docs/checkpoints.md): bitwise up to
            # that checkpoint, then a valid continuation
            worker_stops = [i for i, launch in enumerate(report["launches"][:-1]) if launch["worker_side"]]
            upto = report["launches"][worker_stops[0] + 1]["from_step"] if worker_stops else None
            report["bitwise_until"] = steps if upto is None else upto
            report["metrics_differences"] = compare.compare_metrics(run, reference, steps, upto)
            report["weights_differences"] = compare.compare_weights(run, reference, steps, bitwise=upto is None)
            if upto is not None:
                report["continuation_problems"] = compare.check_continuation(run, steps, upto, _max_staleness(run))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
        if was_reaper is not None:
            process_tree.set_subreaper(was_reaper)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    kinds: dict[str, int] = {}
    for item in report["injections"]:
        kinds[item["kind"]] = kinds.get(item["kind"], 0) + 1
    report["faults_by_kind"] = kinds
    report["restarts"] = len(report["launches"]) - 1
    report["bitwise"] = (report.get("bitwise_until") == steps and not report.get("metrics_differences")
                         and not report.get("weights_differences"))
    report["ok"] = (not report["findings"] and not report.get("metrics_differences")
                    and not report.get("weights_differences") and not report.get("continuation_problems"))
    (work_dir / "chaos.json").write_text(json.dumps(report, indent=1))
    return report


__all__ = ["SETTLE_S", "run_chaos"]
