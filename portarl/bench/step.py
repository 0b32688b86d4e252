"""``portarl bench step``: one GRPO step's cost in portarl, and in TRL's GRPOTrainer (--vs trl).

The work is identical on both sides: the same Qwen2-shaped model built from a config (vocab
64, hidden 64, 2 layers, the same init seed), the same character tokenizer (a Hugging Face
fast tokenizer, so TRL can use it), 8 arithmetic prompts x 8 samples per step, 8 new tokens,
temperature 1 with no top-k / top-p, fp32, the same reward (share of digits in the
completion), AdamW (lr 5e-4, betas 0.9 / 0.99, clip 1.0), PPO clip 0.2 / 0.28, token-mean
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
backward, optimizer). Peak RSS is the process's ``ru_maxrss`` (imports included).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB_CHARS = "0123456789+-*=?., ()abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNO"  # 61 + 3 specials = 64
PROMPTS_PER_STEP, GROUP, NEW_TOKENS, LR = 8, 8, 8, 5e-4
IMPLS = ("portarl", "trl")
STEP_KEYS = ("wall_s", "cpu_s", *(f"{p}_{k}_s" for p in ("rollout", "scoring", "update") for k in ("cpu", "wall")))


# ---------------------------------------------------------------- shared set-up (both workers)
def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set in this process
        pass


def tokenizer():
    """A 64-token character-level Hugging Face fast tokenizer: <pad> 0, <bos> 1, <eos> 2."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(VOCAB_CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    assert len(out) == 64
    return out


def model(seed: int = 0):
    from portarl.models import tiny_qwen2

    return tiny_qwen2(64, seed=seed)


def prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    from portarl.data import arithmetic_examples

    return [(ex.prompt, ex.answer) for ex in arithmetic_examples(n, seed=seed)]


def score(completion: str) -> float:
    """The reward of both sides: the share of digits in the completion text."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def timed(acc: dict, key: str, fn):
    """``fn`` wrapped to add its wall and process CPU time to ``acc[key]`` ([wall, cpu])."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = acc.setdefault(key, [0.0, 0.0])
            spent[0] += time.perf_counter() - w0
            spent[1] += time.process_time() - c0

    return wrapper


def step_record(wall: float, cpu: float, phases: dict, started: float | None = None) -> dict:
    """One step; phases ``{name: [wall, cpu]}`` (rollout, scoring); update = the rest;
    ``started``: its start (``time.time()``), to show that sides stepping in turn did not overlap."""
    out = {"wall_s": wall, "cpu_s": cpu, "started_unix": started}
    for i, kind in enumerate(("wall", "cpu")):
        rollout, scoring = (phases[k][i] if k in phases else None for k in ("rollout", "scoring"))
        out[f"rollout_{kind}_s"], out[f"scoring_{kind}_s"] = rollout, scoring
        total = wall if kind == "wall" else cpu
        out[f"update_{kind}_s"] = total - rollout - (scoring or 0.0) if rollout is not None else None
    return out


def finish(steps: list[dict], threads: int, started: float) -> dict:
    import torch

    return {"steps": steps, "torch_threads": torch.get_num_threads(), "process_s": time.perf_counter() - started,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "threads": threads}


# ---------------------------------------------------------------- taking steps in turn
READY, RESULT = "PORTARL_BENCH_READY", "PORTARL_BENCH_STEP"
GATED = "PORTARL_BENCH_GATED"  # environment: set by the driver when the sides step in turn


def gate() -> None:
    """Before each step of a worker that steps in turn: say so and wait for the driver's go.
    A no-op in a worker run on its own."""
    if not os.environ.get(GATED):
        return
    print(READY, flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("portarl bench step: the driver went away")


# ---------------------------------------------------------------- the portarl worker
def run_portarl(steps: int, threads: int, beta: float) -> dict:
    started = time.perf_counter()
    set_threads(threads)
    from portarl.data import Example
    from portarl.trainer import GRPOTrainer, TrainConfig

    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig.load(None, [
            f"output_dir={tmp}", "device=cpu", "precision.dtype=fp32", f"train.steps={steps}",
            f"train.prompts_per_step={PROMPTS_PER_STEP}", f"rollout.group_size={GROUP}",
            f"rollout.max_new_tokens={NEW_TOKENS}", "rollout.temperature=1.0", "train.sft_warmup_steps=0",
            f"train.micro_batch_size={PROMPTS_PER_STEP * GROUP}", "train.ppo_epochs=1", f"optim.lr={LR}",
            f"loss.kl_coef={beta}", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
            "checkpoint.every=1000000",
        ])
        data = [Example(p, a) for p, a in prompts(PROMPTS_PER_STEP * (steps + 2))]
        trainer = GRPOTrainer(model(), tokenizer(), [(lambda p, c, a: score(c), 1.0)], data, cfg, device="cpu")
        if trainer._uses_reference():
            trainer.ref_model = trainer._make_reference()
        phases: dict = {}
        engine = trainer.rollout
        engine.generate = timed(phases, "rollout", engine.generate)
        import portarl.trainer.grpo as grpo_module

        if callable(getattr(grpo_module, "score", None)):  # trainer split into phase modules (issue 11)
            grpo_module.score = timed(phases, "scoring", grpo_module.score)
        else:  # one-module trainer: the reward call and the no-grad (old / reference) forwards
            for name in ("_rewards", "_no_grad_logprobs"):
                setattr(trainer, name, timed(phases, "scoring", getattr(trainer, name)))
        records = []
        for _ in range(steps):
            gate()
            phases.clear()
            t0, w0, c0 = time.time(), time.perf_counter(), time.process_time()
            trainer.train_step()
            records.append(step_record(time.perf_counter() - w0, time.process_time() - c0, dict(phases), t0))
    return finish(records, threads, started)


# ---------------------------------------------------------------- the driver
def _worker_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("impl", choices=IMPLS)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--beta", type=float, default=0.0)
    args = ap.parse_args(argv)
    if args.impl == "trl":
        from portarl.bench.step_trl import run_trl as run
    else:
        run = run_portarl
    result = run(args.steps, args.threads, args.beta)
    print(f"{RESULT} " + json.dumps(result), flush=True)


def trl_unavailable_reason() -> str | None:
    try:
        import trl  # noqa: F401
    except ImportError as err:
        return f"trl is not installed ({err}); pip install 'portarl[bench]'"
    return None


def worker_command(impl: str, steps: int, threads: int, beta: float) -> list[str]:
    return [sys.executable, "-m", "portarl.bench.step", impl, "--steps", str(steps), "--threads", str(threads),
            "--beta", str(beta)]


class Worker:
    """One fresh worker process for ``impl`` (stderr to a temporary file, so a chatty side
    cannot fill a pipe and stall)."""

    def __init__(self, impl: str, steps: int, threads: int, beta: float, gated: bool):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   TOKENIZERS_PARALLELISM="false")
        env.pop("TRITON_INTERPRET", None)
        env.pop(GATED, None)
        if gated:
            env[GATED] = "1"
        self.impl, self.result = impl, None
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(worker_command(impl, steps, threads, beta), env=env, stdin=subprocess.PIPE,
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


def run_one(impl: str, steps: int, threads: int, beta: float) -> dict:
    """One fresh process for ``impl``, run through; its result dict."""
    return run_in_turn([impl], steps, threads, beta)[impl]


def run_in_turn(order: list[str], steps: int, threads: int, beta: float) -> dict:
    """Fresh processes for ``order``, started together; with two, they take their steps in
    turn (the first in ``order`` first, then swapping every step). Their result dicts."""
    workers = [Worker(impl, steps, threads, beta, gated=len(order) > 1) for impl in order]
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


def summarize_run(run: dict, warmup: int) -> dict:
    timed_steps = run["steps"][warmup:] or run["steps"][-1:]
    return {**{k: _median([s[k] for s in timed_steps]) for k in STEP_KEYS}, "peak_rss_mib": run["peak_rss_mib"],
            "torch_threads": run["torch_threads"], "timed_steps": len(timed_steps)}


def run_bench(*, vs_trl: bool, steps: int, rounds: int, warmup: int, threads: int, beta: float,
              progress=lambda line: None) -> dict:
    impls = ["portarl", "trl"] if vs_trl else ["portarl"]
    out_rounds = []
    for r in range(rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        row: dict = {"order": order}
        runs = run_in_turn(order, steps, threads, beta)
        for impl in order:
            row[impl] = run = runs[impl]
            row[impl + "_median"] = s = summarize_run(run, warmup)
            progress(f"round {r + 1}/{rounds} {impl}: cpu {s['cpu_s'] * 1e3:.1f} ms/step, "
                     f"wall {s['wall_s'] * 1e3:.1f} ms/step, peak RSS {s['peak_rss_mib']:.0f} MiB")
        if vs_trl:
            row["ratio_cpu"] = row["portarl_median"]["cpu_s"] / row["trl_median"]["cpu_s"]
            row["ratio_wall"] = row["portarl_median"]["wall_s"] / row["trl_median"]["wall_s"]
        out_rounds.append(row)
    summary = {impl: {k: _median([row[impl + "_median"][k] for row in out_rounds])
                      for k in (*STEP_KEYS, "peak_rss_mib")}
               for impl in impls}
    if vs_trl:
        summary["ratio_cpu"] = _median([row["ratio_cpu"] for row in out_rounds])
        summary["ratio_wall"] = _median([row["ratio_wall"] for row in out_rounds])
    return {"rounds": out_rounds, "summary": summary, "work": {
        "model": "Qwen2ForCausalLM from a config: vocab 64, hidden 64, 2 layers, 4 heads / 2 kv, mlp 192, fp32",
        "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP, "max_new_tokens": NEW_TOKENS, "beta": beta,
        "steps_per_run": steps, "warmup_steps_dropped": warmup, "threads": threads, "rounds": rounds,
        "in_turn": "steps" if vs_trl else None}}


def machine() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "load_average": os.getloadavg()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    return info


def _ms(v) -> str:
    return "n/a" if v is None else f"{v * 1e3:.1f}"


def markdown(result: dict) -> str:
    s, w = result["summary"], result["work"]
    lines = [f"# `portarl bench step`{' --vs trl' if 'trl' in s else ''}", "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine'].get('cpu', '?')}, "
             f"{result['machine']['cpu_count']} cores; torch {result['machine']['torch']}, trl "
             f"{result['machine']['trl']}; {w['threads']} thread(s) per process; load average at start "
             f"{result['machine']['load_average'][0]:.2f}.  ",
             f"Work per step: {w['prompts_per_step']} prompts x {w['group_size']} samples, {w['max_new_tokens']} new "
             f"tokens, beta {w['beta']}; {w['model']}. {w['steps_per_run']} steps per run, first "
             f"{w['warmup_steps_dropped']} dropped; {w['rounds']} rounds, fresh processes"
             f"{', the two sides taking their steps in turn (first side swapped every step)' if w.get('in_turn') else ''}.",
             "",
             result["conditions"], "", "Per step, median over rounds (ms; phases in process CPU time, wall in brackets):",
             "", "| impl | process CPU | wall | rollout | scoring | update | peak RSS (MiB) |", "|---|---|---|---|---|---|---|"]
    for impl in IMPLS:
        if impl in s:
            m = s[impl]
            ph = " | ".join(f"{_ms(m[f'{p}_cpu_s'])} ({_ms(m[f'{p}_wall_s'])})" for p in ("rollout", "scoring", "update"))
            lines.append(f"| {impl} | {_ms(m['cpu_s'])} | {_ms(m['wall_s'])} | {ph} | {m['peak_rss_mib']:.0f} |")
    if "ratio_cpu" in s:
        lines += ["", "portarl / TRL per round (CPU, wall): " + ", ".join(
            f"{r['ratio_cpu']:.2f}x / {r['ratio_wall']:.2f}x" for r in result["rounds"]),
            f"**Median ratio: process CPU {s['ratio_cpu']:.2f}x, wall {s['ratio_wall']:.2f}x.**"]
    return "\n".join(lines) + "\n"


CONDITIONS = ("The machine is shared with other jobs and loaded: wall times include waiting for a core and "
              "vary with that load; process CPU time counts only this process's own work, so it is the "
              "meaningful number here; phases are given in both. Peak RSS includes each side's imports (TRL pulls in datasets, accelerate, pandas).")


def main(args, progress=lambda line: None) -> tuple[dict, str]:
    vs_trl = getattr(args, "vs", None) == "trl"
    if min(args.steps, args.rounds, args.threads) < 1 or not 0 <= args.warmup < args.steps:
        raise RuntimeError(f"need --steps, --rounds, --threads >= 1 and 0 <= --warmup < --steps; got steps {args.steps}, "
                           f"rounds {args.rounds}, threads {args.threads}, warmup {args.warmup}")
    if vs_trl and (reason := trl_unavailable_reason()):
        raise RuntimeError(reason)
    result = run_bench(vs_trl=vs_trl, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                       threads=args.threads, beta=args.beta, progress=progress)
    result["command"] = (f"portarl bench step{' --vs trl' if vs_trl else ''} --steps {args.steps} --warmup {args.warmup} "
                         f"--rounds {args.rounds} --threads {args.threads} --beta {args.beta}")
    result["machine"], result["conditions"] = machine(), CONDITIONS
    return result, markdown(result)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
