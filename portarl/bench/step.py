"""``portarl bench step``: one GRPO step's cost in portarl, and in TRL's GRPOTrainer (--vs trl).

The work is identical on both sides: the same Qwen2-shaped model built from a config (vocab
64, hidden 64, 2 layers, the same init seed), the same character tokenizer (a Hugging Face
fast tokenizer, so TRL can use it), 8 arithmetic prompts x 8 samples per step, 8 new tokens,
temperature 1 with no top-k / top-p, fp32, the same reward (share of digits in the
completion; :mod:`portarl.bench.step_work` for the flags that change the work), AdamW
(lr 5e-4, betas 0.9 / 0.99, clip 1.0), PPO clip 0.2 / 0.28, token-mean
loss (TRL: ``dapo``), one policy update per rollout, KL weight ``beta`` (default 0: no
reference model on either side), gradient checkpointing off.

Each run is a fresh process with the same thread count (``torch.set_num_threads`` and the
OMP / MKL variables). With ``--vs trl`` both sides of a round are started together and take
their steps in turn, one step at a time (the driver lets one process step while the other
waits on a pipe, using no CPU), and which side goes first swaps every step. Why: on a
shared virtual machine the speed of the same process drifts by +-30% over seconds
(measured: 48-83 ms per step for identical runs); whole runs in turn caught different
phases of that drift, steps in turn share it. Per step: wall time and process CPU time
(``time.process_time``: every thread of the process, unaffected by other processes waiting
for the cores, hence the meaningful number on a shared, loaded machine); the first
``warmup`` steps are dropped. Phases, timed by wrapping methods from outside (no trainer
edits): rollout (portarl: ``rollout.generate``; TRL: ``_generate``), scoring (portarl:
rewards and the no-grad old / reference log-prob forwards, or the whole ``scoring.score``
phase once the trainer is split into phase modules; with ``train.old_logprobs=auto``, the
default, the on-policy old log-probs come from the update's forward and there is no old
forward in scoring; TRL: the rest of
``_generate_and_score_completions``), update (the remainder of the step: loss forward,
backward, optimizer). Peak RSS is the process's ``ru_maxrss`` (imports included); the
resident set after the model and tokenizer are loaded (before the trainer is built) is the
baseline, and peak - baseline the step's own memory.

``--model PATH`` and the work flags (:mod:`portarl.bench.step_work`: README settings by
default, checkpointing on on both sides) run the same comparison on a real model. Then the
sides run one after the other by default (``--schedule sides``): two copies of a real
model's training state at once may not fit in memory, and each side's peak is then its
own. ``--schedule steps`` keeps stepping in turn.

``--async`` (with ``--model``) adds a third side, ``portarl-async``: portarl in
``rollout.mode: async``, its trainer and its rollout worker with half of ``--threads``
each, i.e. the same cores as the other sides (:mod:`portarl.bench.step_portarl`). Every
side reports samples per second (samples per step over the median wall step) and the
reward per sample beside its CPU time; with ``--vs trl`` the samples per second of each
portarl side over TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from portarl.bench.step_report import CONDITIONS, IMPLS, machine, markdown
from portarl.bench.step_side import GATED, READY, RESULT
from portarl.bench.step_work import Work, add_arguments, work_from_args

STEP_KEYS = ("wall_s", "cpu_s", *(f"{p}_{k}_s" for p in ("rollout", "scoring", "update") for k in ("cpu", "wall")))
MEMORY_KEYS = ("peak_rss_mib", "baseline_rss_mib", "rss_increase_mib")


# ---------------------------------------------------------------- the driver
def _worker_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("impl", choices=IMPLS)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.impl == "trl":
        from portarl.bench.step_trl import run_trl

        result = run_trl(args.steps, args.threads, work_from_args(args))
    else:
        from portarl.bench.step_portarl import run_portarl

        result = run_portarl(args.steps, args.threads, work_from_args(args),
                             "async" if args.impl == "portarl-async" else "colocated")
    print(f"{RESULT} " + json.dumps(result), flush=True)


def check_async_side(work: Work, threads: int, warmup: int, schedule: str) -> None:
    """Refuse, naming the flag, what the ``portarl-async`` side cannot measure."""
    if work.model is None:
        raise ValueError("--async needs --model PATH: the rollout worker builds its model from a path")
    if threads < 2:
        raise ValueError(f"--async with --threads {threads}: the async side splits the side's threads between its "
                         "trainer and its rollout worker (the same cores as the other sides); use --threads 2 or more")
    if warmup < 1:
        raise ValueError("--async needs --warmup 1 or more: its first step includes the worker's start-up")
    if schedule != "sides":
        raise ValueError("--async needs --schedule sides: a gated async side's worker would generate while the other "
                         "sides step")


def trl_unavailable_reason() -> str | None:
    try:
        import trl  # noqa: F401
    except ImportError as err:
        return f"trl is not installed ({err}); pip install 'portarl[bench]'"
    return None


def worker_command(impl: str, steps: int, threads: int, work: Work) -> list[str]:
    return [sys.executable, "-m", "portarl.bench.step", impl, "--steps", str(steps), "--threads", str(threads),
            *work.argv()]


class Worker:
    """One fresh worker process for ``impl`` (stderr to a temporary file, so a chatty side
    cannot fill a pipe and stall)."""

    def __init__(self, impl: str, steps: int, threads: int, work: Work, gated: bool):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   TOKENIZERS_PARALLELISM="false")
        env.pop("TRITON_INTERPRET", None)
        env.pop(GATED, None)
        if gated:
            env[GATED] = "1"
        self.impl, self.result = impl, None
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(worker_command(impl, steps, threads, work), env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True)

    def wait_turn(self) -> bool:
        """Read until the worker waits for its next go (True) or has printed its result
        (False)."""
        for line in self.proc.stdout:
            if line.strip() == READY:
                return True
            if line.startswith(RESULT + " "):
                self.result = json.loads(line.split(" ", 1)[1])
                return False
        self.proc.wait()
        self.stderr.seek(0)
        raise RuntimeError(f"bench step worker {self.impl} failed (exit {self.proc.returncode}):\n"
                           f"{self.stderr.read()[-4000:]}")

    def go(self) -> bool:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.wait_turn()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def run_one(impl: str, steps: int, threads: int, work: Work) -> dict:
    """One fresh process for ``impl``, run through; its result dict."""
    return run_in_turn([impl], steps, threads, work)[impl]


def run_sides(order: list[str], steps: int, threads: int, work: Work, done=lambda impl, run: None) -> dict:
    """One fresh process per side, one after the other (each ended before the next starts:
    a side's peak memory is its own, and two real models' training state never coexist);
    ``done(impl, run)`` as each side ends (a real model's side takes minutes)."""
    runs = {}
    for impl in order:
        runs[impl] = run_one(impl, steps, threads, work)
        done(impl, runs[impl])
    return runs


def run_in_turn(order: list[str], steps: int, threads: int, work: Work) -> dict:
    """Fresh processes for ``order``, started together; with two, they take their steps in
    turn (the first in ``order`` first, then swapping every step). Their result dicts."""
    workers = [Worker(impl, steps, threads, work, gated=len(order) > 1) for impl in order]
    try:
        if len(workers) == 1:
            workers[0].wait_turn()
        else:
            waiting = [w.wait_turn() for w in workers]  # set-up done, each waits for its first step
            step = 0
            while any(waiting):
                for i in (range(len(workers)) if step % 2 == 0 else reversed(range(len(workers)))):
                    if waiting[i]:
                        waiting[i] = workers[i].go()
                step += 1
        return {w.impl: w.result for w in workers}
    finally:
        for w in workers:
            w.close()


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize_run(run: dict, warmup: int, samples_per_step: int) -> dict:
    """Medians over the timed steps; samples per second from the median wall step; the reward
    per sample over every step (it does not depend on timing, so the warm-up counts too)."""
    timed_steps = run["steps"][warmup:] or run["steps"][-1:]
    out = {**{k: _median([s.get(k) for s in timed_steps]) for k in STEP_KEYS},
           **{k: run.get(k) for k in MEMORY_KEYS}, "torch_threads": run["torch_threads"],
           "timed_steps": len(timed_steps)}
    out["samples_per_s"] = samples_per_step / out["wall_s"]
    rewards = [s["reward_mean"] for s in run["steps"] if s.get("reward_mean") is not None]
    out["reward_mean"] = statistics.fmean(rewards) if rewards else None
    return out


def run_bench(*, vs_trl: bool, steps: int, rounds: int, warmup: int, threads: int, work: Work,
              schedule: str = "steps", progress=lambda line: None, with_async: bool = False) -> dict:
    """``rounds`` rounds of every side (the order alternated); ``schedule``: ``steps`` (the
    sides started together, stepping in turn) or ``sides`` (one after the other);
    ``with_async``: the ``portarl-async`` side too."""
    impls = ["portarl"] + (["portarl-async"] if with_async else []) + (["trl"] if vs_trl else [])
    out_rounds = []
    for r in range(rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        row: dict = {"order": order}

        def done(impl, run, row=row, r=r):
            row[impl] = run
            row[impl + "_median"] = s = summarize_run(run, warmup, work.samples)
            progress(f"round {r + 1}/{rounds} {impl}: cpu {s['cpu_s'] * 1e3:.1f} ms/step, "
                     f"wall {s['wall_s'] * 1e3:.1f} ms/step ({s['samples_per_s']:.2f} samples/s), peak RSS {s['peak_rss_mib']:.0f} MiB "
                     f"({s['rss_increase_mib']:.0f} MiB over the {s['baseline_rss_mib']:.0f} MiB after load)")

        if schedule == "sides":
            run_sides(order, steps, threads, work, done)
        else:
            runs = run_in_turn(order, steps, threads, work)
            for impl in order:
                done(impl, runs[impl])
        if vs_trl:
            row["ratio_cpu"] = row["portarl_median"]["cpu_s"] / row["trl_median"]["cpu_s"]
            row["ratio_wall"] = row["portarl_median"]["wall_s"] / row["trl_median"]["wall_s"]
        out_rounds.append(row)
    summary = {impl: {k: _median([row[impl + "_median"][k] for row in out_rounds])
                      for k in (*STEP_KEYS, *MEMORY_KEYS, "samples_per_s", "reward_mean")}
               for impl in impls}
    if vs_trl:
        summary["samples_per_s_vs_trl"] = {impl: summary[impl]["samples_per_s"] / summary["trl"]["samples_per_s"]
                                           for impl in impls if impl != "trl"}
        summary["ratio_cpu"] = _median([row["ratio_cpu"] for row in out_rounds])
        summary["ratio_wall"] = _median([row["ratio_wall"] for row in out_rounds])
        summary["ratio_peak_rss"] = summary["portarl"]["peak_rss_mib"] / summary["trl"]["peak_rss_mib"]
    return {"rounds": out_rounds, "summary": summary, "work": {
        **work.describe(), "steps_per_run": steps, "warmup_steps_dropped": warmup, "threads": threads,
        "rounds": rounds, "in_turn": schedule if vs_trl else None}}


def main(args, progress=lambda line: None) -> tuple[dict, str]:
    vs_trl = getattr(args, "vs", None) == "trl"
    if min(args.steps, args.rounds, args.threads) < 1 or not 0 <= args.warmup < args.steps:
        raise RuntimeError(f"need --steps, --rounds, --threads >= 1 and 0 <= --warmup < --steps; got steps {args.steps}, "
                           f"rounds {args.rounds}, threads {args.threads}, warmup {args.warmup}")
    work = work_from_args(args)
    work.check()
    schedule = getattr(args, "schedule", None)
    with_async = bool(getattr(args, "with_async", False))
    if schedule is not None and not (vs_trl or with_async):
        raise ValueError(f"--schedule {schedule} orders the sides of --vs trl / --async: add one or leave it out")
    schedule = schedule or ("sides" if work.model is not None else "steps")
    if with_async:
        check_async_side(work, args.threads, args.warmup, schedule)
    if vs_trl and (reason := trl_unavailable_reason()):
        raise RuntimeError(reason)
    result = run_bench(vs_trl=vs_trl, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                       threads=args.threads, work=work, schedule=schedule, progress=progress, with_async=with_async)
    spelled = f"--beta {work.beta}" if work == Work(beta=work.beta) else " ".join(work.argv())
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    result["command"] = (f"{f'MALLOC_MMAP_THRESHOLD_={threshold} ' if threshold else ''}portarl bench step"
                         f"{' --vs trl' if vs_trl else ''}{' --async' if with_async else ''} --steps {args.steps} --warmup {args.warmup} "
                         f"--rounds {args.rounds} --threads {args.threads} {spelled}"
                         f"{f' --schedule {schedule}' if (vs_trl or with_async) and work.model is not None else ''}")
    result["machine"], result["conditions"] = machine(), CONDITIONS
    return result, markdown(result)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
