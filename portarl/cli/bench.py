"""``portarl bench``: kernels, stability (with dump / locate), step, async and memory.

The subcommands' handlers and their parser, kept out of :mod:`portarl.cli.main` so each module
stays one job: main.py routes, this module benchmarks. Nothing here imports torch at module
level.
"""

from __future__ import annotations


from portarl.cli.common import _int_at_least, _log, _missing_train_extra, _setup_logging

#: Where bench output goes by default (bench/results/ holds the committed results).
BENCH_OUT = "runs/bench"


def _device_slug(name: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def _parse_shapes(items: list[str], ops: list[str]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """``--shapes`` of ``bench kernels``: ``NxV`` items (logprobs, kl), ``NxHxV`` (linear_logprobs).

    Given shapes replace the defaults of the ops they fit, so each selected op must get at
    least one shape of its form and each shape must fit a selected op: otherwise the
    defaults would run silently in place of what was asked for.
    """
    rows, linear = [], []
    for item in items:
        try:
            dims = tuple(int(d) for d in item.lower().split("x"))
        except ValueError:
            dims = ()
        if len(dims) not in (2, 3) or min(dims) <= 0:
            raise ValueError(f"--shapes {item!r}: expected NxV (logprobs, kl) or NxHxV (linear_logprobs), "
                             "positive integers, e.g. 4096x151936 or 4096x896x151936")
        (rows if len(dims) == 2 else linear).append(dims)
    if items:
        row_ops = [op for op in ops if op in ("logprobs", "kl")]
        if rows and not row_ops:
            raise ValueError(f"--shapes {'x'.join(map(str, rows[0]))} is NxV (logprobs, kl) but --ops is "
                             f"{' '.join(ops)}: give NxHxV for linear_logprobs, e.g. 4096x896x151936")
        if linear and "linear_logprobs" not in ops:
            raise ValueError(f"--shapes {'x'.join(map(str, linear[0]))} is NxHxV (linear_logprobs) but --ops is "
                             f"{' '.join(ops)}: give NxV for logprobs and kl, e.g. 4096x151936")
        if row_ops and not rows:
            raise ValueError(f"--shapes has no NxV shape for --ops {' '.join(row_ops)}: add one (e.g. 4096x151936) "
                             "or leave those ops out of --ops")
        if "linear_logprobs" in ops and not linear:
            raise ValueError("--shapes has no NxHxV shape for --ops linear_logprobs: add one (e.g. 4096x896x151936) "
                             "or leave linear_logprobs out of --ops")
    return rows, linear


def _cmd_bench_kernels(args) -> int:
    import dataclasses
    import json

    import torch
    from pathlib import Path

    from portarl.backends.device import DeviceUnavailableError, resolve_device

    out = Path(args.out) if args.out else None
    try:  # every argument checked before a minute of benchmarking, not after
        row_shapes, linear_shapes = _parse_shapes(args.shapes or [], args.ops)
        if out is not None and (out.is_dir() or out.with_suffix(".md").is_dir()):
            raise ValueError(f"--out {out} is a directory: give a file name, e.g. {out / 'kernels.json'}")
        device = resolve_device(args.device)
    except (DeviceUnavailableError, ValueError) as err:
        _log(f"portarl bench kernels: {err}")
        return 2
    from portarl.backends import envinfo
    from portarl.bench.kernels import QUICK_SHAPES, markdown_table, run_kernels

    from portarl.bench.linear import QUICK_LINEAR_SHAPES, linear_table, liger_status, run_linear

    env = envinfo.environment(device)
    shapes = row_shapes or (QUICK_SHAPES if args.quick else None)
    results, bandwidth, table = [], 0.0, ""
    if set(args.ops) & {"logprobs", "kl"}:
        results, bandwidth = run_kernels(device, shapes=shapes, dtypes=args.dtypes, repeats=args.repeats, progress=_log)
        table = markdown_table(results, env["device_name"], bandwidth)
    if "linear_logprobs" in args.ops:
        linear = run_linear(device, shapes=linear_shapes or (QUICK_LINEAR_SHAPES if args.quick else None),
                            dtypes=args.dtypes, repeats=args.repeats, modes=args.modes, progress=_log)
        results += linear
        conditions = (f"{env['device_name']}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
                      f"median of {args.repeats} alternating repeats, memory from the warm-up call")
        table += ("\n## linear_logprobs (hidden [N, H] x weight [V, H] -> log-probs)\n\n"
                  + linear_table(linear, conditions, liger=liger_status(device)))
    print(table)
    out = out or Path(BENCH_OUT) / f"kernels-{_device_slug(env['device_name'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "copy_bandwidth_bytes_per_s": bandwidth,
                               "results": [dataclasses.asdict(r) for r in results]}, indent=1) + "\n")
    out.with_suffix(".md").write_text(f"# Kernel benchmarks: {env['device_name']}\n\n" + table)
    print(f"written: {out} and {out.with_suffix('.md')}")
    return 0


def _cmd_bench_stability(args) -> int:
    if _missing_train_extra("bench stability"):
        return 2
    from portarl.bench.stability.cli import cmd_stability

    _setup_logging()
    return cmd_stability(args)


def _cmd_bench_memory(args) -> int:
    from portarl.bench.memory import main as bench_memory

    argv = [*(["--config", args.config] if args.config else []), *(x for item in args.set for x in ("--set", item)),
            "--nproc", str(args.nproc), "--threads", str(args.threads), "--steps", str(args.steps),
            *(["--malloc-mmap-threshold", str(args.malloc_mmap_threshold)] if args.malloc_mmap_threshold else [])]
    try:
        return bench_memory(argv)
    except RuntimeError as err:
        _log(f"portarl bench memory: {err}")
        return 2


def _write_bench(name: str, run, args) -> int:
    """Run a ``bench`` command (``run(args, progress) -> (result, table)``), print its table
    and write ``--out`` (JSON, with the table as .md beside it); its errors: one line, exit 2."""
    import json
    from pathlib import Path

    try:
        result, table = run(args, progress=_log)
    except (RuntimeError, ValueError) as err:
        _log(f"portarl bench {name}: {err}")
        return 2
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(table)
        print(f"written: {out} and {out.with_suffix('.md')}")
    return 0


def _cmd_bench_step(args) -> int:
    if args.device is not None:
        return _write_bench("step", _bench_step_device, args)
    from portarl.bench.step import main as bench_step

    return _write_bench("step", bench_step, args)


def _bench_step_device(args, progress=lambda line: None):
    """``bench step --device``: portarl's whole step beside the plain one, in this process."""
    from portarl.bench.step_device import markdown, run

    if args.vs or args.with_async:
        raise ValueError("--device runs portarl against the plain step in one process; leave out --vs / --async")
    result = run(args.device, args.shapes or (["tiny"] if args.device == "cpu" else ["qwen2.5-0.5b", "qwen2.5-1.5b"]),
                 progress=progress, steps=args.device_steps, warmup=args.device_warmup,
                 new_tokens=args.device_new_tokens)
    return result, markdown(result)


def _cmd_bench_async(args) -> int:
    if _missing_train_extra("bench async"):
        return 2
    from portarl.bench.async_rollout import main as bench_async

    return _write_bench("async", bench_async, args)


def _cmd_bench_chaos(args) -> int:
    if _missing_train_extra("bench chaos"):
        return 2
    from portarl.bench.chaos.report import main as bench_chaos

    code = _write_bench("chaos", bench_chaos, args)
    if code == 0 and args.out:
        import json
        from pathlib import Path

        return 0 if all(r["ok"] for r in json.loads(Path(args.out).read_text())["runs"]) else 1
    return code


def add_parser(commands) -> None:
    """The ``bench`` subcommand and its own subcommands, on the top-level parser's ``commands``."""
    bench = commands.add_parser(
        "bench", help="kernel speed / memory, training stability across settings, per-step cost",
        description="Benchmarks. kernels: speed and peak memory of the fused ops (logprobs, kl, linear_logprobs) "
                    "against eager PyTorch and others; stability: one config trained under several device / dtype "
                    "settings, the runs compared; step: per-step CPU / wall time, phases and peak RSS (optionally "
                    "beside TRL); async: colocated vs asynchronous rollout in one wall-clock budget; memory: "
                    "one step's measured peak RSS beside the memory plan. Results go under runs/bench unless --out "
                    "says otherwise.")
    bench_cmds = bench.add_subparsers(dest="bench_command", required=True)
    k = bench_cmds.add_parser(
        "kernels", help="logprobs, kl and linear_logprobs: portarl backends vs eager, row loop, Liger",
        description="Time and measure peak memory of the fused ops (logprobs, kl: [N, V] logits; linear_logprobs: "
                    "hidden [N, H] x weight [V, H]) for every backend usable on the device, against eager PyTorch, "
                    "a row loop and Liger-Kernel where installed. Prints a markdown table and writes JSON + .md.")
    k.add_argument("--device", default="auto", help="auto (default), cuda, npu, cpu or e.g. cuda:1")
    k.add_argument("--out", help=f"JSON output (a .md table is written beside it); default {BENCH_OUT}/kernels-<device>.json "
                   "(bench/results/ holds the committed results: write there on purpose only)")
    k.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32", "fp16"],
                   help="logits / hidden-state precisions to time (default: bf16 fp32)")
    k.add_argument("--repeats", default=5,
                   type=_int_at_least(1, " (timed repetitions; the median of them is reported)"),
                   help="timed repetitions per case after one warm-up; the median is reported (default 5, >= 1)")
    k.add_argument("--quick", action="store_true", help="one tiny shape (smoke test)")
    k.add_argument("--shapes", nargs="+", metavar="SHAPE",
                   help="NxV for logprobs and kl, NxHxV for linear_logprobs (e.g. 4096x896x151936); "
                        "replaces that op's default shapes")
    k.add_argument("--ops", nargs="+", default=["logprobs", "kl", "linear_logprobs"],
                   choices=["logprobs", "kl", "linear_logprobs"], help="which ops to benchmark")
    k.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"],
                   help="linear_logprobs: forward only, and/or forward + backward (default both)")
    k.set_defaults(func=_cmd_bench_kernels)
    st = bench_cmds.add_parser(
        "stability", help="train one config under several settings and compare the runs",
        description="Train one config under several device / dtype / backend settings (each run in its own "
                    "process) and report where their metrics part: report.md, stability.png, stability.json. "
                    "`compare` builds the same report from run directories made on any machines.")
    st.add_argument("--runs", default="cpu:fp32,cpu:bf16,cpu:bf16:npu-emulated",
                    help="comma-separated device:dtype[:backend-or-profile], e.g. cuda:bf16,npu:bf16 or cpu:bf16:npu-emulated")
    st.add_argument("--steps", type=int, default=None, help="GRPO steps (default 100; with --replay-from: the recording's)")
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--config", help="training config YAML (default: the built-in demo config)")
    st.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override for every run")
    st.add_argument("--out", default=f"{BENCH_OUT}/stability", help="output directory (report.md, stability.png, stability.json)")
    st.add_argument("--replay-rollouts", action="store_true",
                    help="record the first run's rollouts and feed them to the others (isolates trainer numerics)")
    st.add_argument("--threshold", type=float, default=0.1, help="parting threshold, as a fraction of a metric's typical size")
    st.set_defaults(func=_cmd_bench_stability)
    st_cmds = st.add_subparsers(dest="stability_command")
    st_compare = st_cmds.add_parser("compare", help="one report over run directories made on any machines; exit 1 when a run parts")
    st_dump = st_cmds.add_parser("dump", help="one recorded step's forward and backward, dumped per module on this machine")
    st_locate = st_cmds.add_parser("locate", help="the first module where two dumps part, forward and backward")
    st_pack = st_cmds.add_parser("pack", help="one .tar of a stability directory (compare / --replay-from / dump take it)")
    from portarl.bench.stability.cli import add_arguments as _stability_arguments
    from portarl.bench.stability.cli import add_locate_arguments as _locate_arguments
    from portarl.bench.stability.cli import add_pack_arguments as _pack_arguments

    _stability_arguments(st, st_compare)
    _locate_arguments(st_dump, st_locate)
    _pack_arguments(st_pack)
    sp = bench_cmds.add_parser(
        "step", help="per-step CPU / wall time, phases and peak RSS; --vs trl: TRL's GRPOTrainer on the same work",
        description="Run short GRPO trainings in fresh processes and report the median per-step CPU and wall "
                    "time, the time per phase (rollout, scoring, update) and peak RSS; with --vs trl, TRL's "
                    "GRPOTrainer on the same model, data and batch, rounds alternated. --model PATH: a real model "
                    "(Hugging Face directory or .gguf) at the README's own-data settings unless the work flags say "
                    "otherwise; peak RSS per side with its increase over the resident set after load. Set "
                    "MALLOC_MMAP_THRESHOLD_ in the environment to fix glibc's threshold in the workers (docs/memory.md).")
    sp.add_argument("--vs", choices=["trl"], help="also run TRL's GRPOTrainer (pip install 'portarl[bench]')")
    sp.add_argument("--device", help="cuda (or cpu): a whole step of a real-size model (--shapes) against the plain "
                    "step (full logits, log_softmax, gather) in one process, instead of the CPU runs below")
    sp.add_argument("--shapes", nargs="+", metavar="SHAPE",
                    help="with --device: qwen2.5-0.5b, qwen2.5-1.5b (the default on cuda), tiny (cpu's default)")
    sp.add_argument("--device-steps", type=int, help="with --device: steps per shape (default 3 on cuda)")
    sp.add_argument("--device-warmup", type=int, help="with --device: steps left out of the medians (default 1)")
    sp.add_argument("--device-new-tokens", type=int, help="with --device: tokens per completion (default 512 on cuda)")
    sp.add_argument("--steps", type=int, default=6, help="steps per run (fresh process each)")
    sp.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the medians")
    sp.add_argument("--rounds", type=int, default=5, help="rounds; each runs every side once, order alternated")
    sp.add_argument("--threads", type=int, default=1, help="torch / OMP / MKL threads in every run")
    sp.add_argument("--async", dest="with_async", action="store_true",
                    help="with --model: also portarl in rollout.mode=async, its trainer and rollout worker sharing "
                         "--threads (half each: the same cores as the other sides); reports samples/s and reward "
                         "per sample beside the others'")
    sp.add_argument("--schedule", choices=["steps", "sides"],
                    help="with --vs trl: steps: both sides started together, taking their steps in turn (default "
                         "without --model); sides: one side after the other, so their memory never adds up (default "
                         "with --model)")
    from portarl.bench.step_work import add_arguments as _step_work_arguments

    _step_work_arguments(sp)
    sp.add_argument("--out", help="JSON output (a .md table is written beside it)")
    sp.set_defaults(func=_cmd_bench_step)
    sa = bench_cmds.add_parser("async", help="rollout.mode colocated vs async: samples/s and reward in the same "
                               "wall-clock budget, with a core per process (beside the ideal overlap, in wall and "
                               "CPU time) and on the same cores")
    sa.add_argument("--config", help="training config (default: the built-in demo)")
    sa.add_argument("--set", action="append", metavar="FIELD=VALUE", help="config override (repeatable)")
    sa.add_argument("--budget-s", type=float, default=60.0, help="seconds of GRPO steps per mode (default 60)")
    sa.add_argument("--threads", type=int, default=1,
                    help="torch / OMP threads per process (default 1): colocated and each async process get this "
                         "many; the same-cores colocated run twice as many")
    sa.add_argument("--no-same-cores", dest="same_cores", action="store_false",
                    help="leave out the colocated run on the async run's cores (2 x --threads threads)")
    sa.add_argument("--no-partial", dest="partial", action="store_false",
                    help="leave out the partial-rollout runs (rollout.partial, at the config's max_staleness and at 2)")
    sa.add_argument("--lengths", metavar="SPEC",
                    help="completion lengths set by the benchmark, the same for every run: tail:MIN:MAX (a heavy tail "
                    "drawn from each sample's seed) or even:N (PORTARL_BENCH_LENGTHS; hf engine)")
    sa.add_argument("--work-dir", help="where the runs go (default: a temporary directory)")
    sa.add_argument("--reuse", action="store_true", help="no new runs: report on those already in --work-dir")
    sa.add_argument("--out", help="JSON output (a .md table is written beside it)")
    sa.set_defaults(func=_cmd_bench_async)
    ch = bench_cmds.add_parser("chaos", help="a run restarted with --resume-or-start after seeded random faults "
                               "(kills, full disk, judge outage, a failing reward), compared with the uninterrupted "
                               "run; exit 1 when one differs or leaves a process or lock behind")
    ch.add_argument("--mode", nargs="+", default=["colocated"],
                    choices=["colocated", "async", "torchrun", "ulysses", "moe"], help="modes to run (default colocated)")
    ch.add_argument("--steps", type=_int_at_least(2), default=100, help="GRPO steps of each run (default 100)")
    ch.add_argument("--faults", type=_int_at_least(0), default=20, help="faults per chaos run (default 20)")
    ch.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (default 0)")
    ch.add_argument("--checkpoint-every", type=_int_at_least(1), default=2, help="checkpoint.every (default 2)")
    ch.add_argument("--work-dir", default="runs/chaos", help="where the runs and chaos.json go (default runs/chaos)")
    ch.add_argument("--out", help="JSON output of every mode's report (a .md table beside it)")
    ch.set_defaults(func=_cmd_bench_chaos)
    mem = bench_cmds.add_parser("memory", help="one GRPO step's measured peak RSS increase and time beside the "
                                "memory plan's estimate (CPU; a fresh process per rank)")
    mem.add_argument("--config", help="training config YAML (default: the built-in demo config)")
    mem.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    mem.add_argument("--nproc", type=int, default=1, help="ranks (torchrun, Gloo, FSDP2)")
    mem.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    mem.add_argument("--steps", type=int, default=1, help="GRPO steps (1: compared with the plan's first step)")
    mem.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                     help="glibc MALLOC_MMAP_THRESHOLD_ for the workers (RSS then follows the live tensors)")
    mem.set_defaults(func=_cmd_bench_memory)
