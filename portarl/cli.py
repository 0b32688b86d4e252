"""The ``portarl`` command line.

    portarl parity [--device auto|cuda|npu|cpu] [--out report.json] [--backends ...]
                   [--dtypes ...] [--include-large] [--repeats N]
    portarl parity compare A.json B.json [--backend-a NAME] [--backend-b NAME]
    portarl train [--config FILE.yaml] [--set key=value ...] [--device D] [--output-dir DIR] [--steps N]
                  [--resume | --overwrite]
    portarl sft   [--config FILE.yaml] [--set key=value ...] [--device D] [--output-dir DIR] [--steps N] [--overwrite]
    portarl export --checkpoint C --out DIR [--overwrite]
    portarl plan  [--config FILE.yaml] [--set key=value ...] [--devices N] [--device-memory 80GiB]
    portarl bench kernels | stability [compare | dump | locate] ...
    portarl bench step [--vs trl] [--steps N] [--rounds R] [--threads T] [--out FILE.json]
    portarl bench memory [--config FILE.yaml] [--set key=value ...] [--nproc N]
    portarl --version

Exit status: 0 on success, 1 when a parity check fails or ``plan`` says the run does not fit, 2 for bad usage, a bad config, an
output directory holding another run, a model directory or data that cannot be used, an
unusable device, no checkpoint that verifies on --resume, or a missing / incomplete /
damaged checkpoint or a non-empty --out for export (one line on stderr, no
traceback), 3 when training stopped itself (persistent non-finite values; a checkpoint was
saved), 128 + the signal number on SIGINT (130) or SIGTERM (143): after the current step and
a checkpoint on the first signal, at once on a second (the message says whether a checkpoint
exists for the last step).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from portarl import __version__, cli_train

#: ``portarl --help``: what the tool is, before the list of commands.
DESCRIPTION = ("portarl: RL post-training (GRPO family) of language models with the same numbers\n"
               "on CUDA GPUs, Ascend NPUs and CPU. `portarl train` with no arguments trains a built-in\n"
               "tiny model on arithmetic (300 steps, a few minutes on a CPU; `make demo` runs 60).")
EPILOG = """examples:
  portarl train                                   GRPO on the built-in tiny model (output: runs/train)
  portarl train --config examples/smollm2-arith.yaml
  portarl train --output-dir runs/x --resume      continue a run from its latest checkpoint
  portarl export --checkpoint runs/x --out model  a Hugging Face model directory
  portarl parity --device auto                    fused ops against float64 on this device
  portarl bench kernels --quick                   kernel speed and memory

exit status: 0 ok, 1 parity disagreement, 2 bad usage / config / input (one line on stderr),
3 training stopped itself (a checkpoint was saved), 130 / 143 on SIGINT / SIGTERM."""

#: Where ``bench`` writes by default: beside the training runs, not into the committed
#: ``bench/results/`` (a run in the repository root used to overwrite the committed table).
BENCH_OUT = "runs/bench"


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _prepare_interpreter(device) -> None:
    """On CPU, build the Triton kernels for the interpreter so the cuda backend is checked too.

    Must happen before :mod:`portarl.kernels` is imported (triton decides at decoration time).
    """
    if device.type == "cpu" and "portarl.kernels" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _cmd_parity(args) -> int:
    import torch  # noqa: F401  (imported here so `portarl --help` stays fast)

    from portarl.device import DeviceUnavailableError, resolve_device

    try:
        device = resolve_device(args.device)
    except (DeviceUnavailableError, ValueError) as err:
        _log(f"portarl parity: {err}")
        return 2
    _prepare_interpreter(device)

    from portarl import envinfo
    from portarl.backends import BACKEND_NAMES, get_backend_by_name
    from portarl.parity import report as report_lib
    from portarl.parity.sweep import backends_for, run_sweep

    if args.backends:
        for name in args.backends:
            if name not in BACKEND_NAMES:
                _log(f"portarl parity: --backends {name!r} is not one of {', '.join(BACKEND_NAMES)}")
                return 2
            reason = get_backend_by_name(name).unavailable_reason(device)
            if reason is not None:
                _log(f"portarl parity: backend {name!r} cannot run on {device}: {reason}")
                return 2
    backends = args.backends or backends_for(device)
    env = envinfo.environment(device)
    _log(f"portarl parity on {device} ({env['device_name']}); backends: {', '.join(backends)}; dtypes: {', '.join(args.dtypes)}")
    records = run_sweep(
        device,
        backends=backends,
        dtypes=args.dtypes,
        include_hardware_cases=args.include_large,
        repeats=args.repeats if args.repeats is not None else (0 if device.type == "cpu" else 3),
        progress=_log,
    )
    report = report_lib.build_report(device, records, env)
    print(report_lib.format_table(records))
    print(report_lib.summary(records))
    if args.out:
        path = report_lib.write_report(report, args.out)
        print(f"report written to {path}")
    return 0 if report["passed"] else 1


def _cmd_compare(args) -> int:
    from portarl.parity import report as report_lib

    try:
        a = report_lib.read_report(args.report_a)
        b = report_lib.read_report(args.report_b)
        rows = report_lib.compare_reports(a, b, args.backend_a, args.backend_b)
    except (FileNotFoundError, ValueError) as err:
        _log(f"portarl parity compare: {err}")
        return 2
    print(report_lib.format_comparison(rows, a, b))
    return 0 if all(r.passed for r in rows) else 1


def _setup_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


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


def _int_at_least(low: int, why: str = ""):
    """An argparse type: an integer >= ``low`` (``why`` is added to the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}{why}, got {value}")
        return value

    return parse


def _cmd_bench_kernels(args) -> int:
    import dataclasses
    import json

    import torch
    from pathlib import Path

    from portarl.device import DeviceUnavailableError, resolve_device

    out = Path(args.out) if args.out else None
    try:  # every argument checked before a minute of benchmarking, not after
        row_shapes, linear_shapes = _parse_shapes(args.shapes or [], args.ops)
        if out is not None and (out.is_dir() or out.with_suffix(".md").is_dir()):
            raise ValueError(f"--out {out} is a directory: give a file name, e.g. {out / 'kernels.json'}")
        device = resolve_device(args.device)
    except (DeviceUnavailableError, ValueError) as err:
        _log(f"portarl bench kernels: {err}")
        return 2
    from portarl import envinfo
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


def _missing_train_extra(command: str) -> bool:
    """True (after logging the one-line install hint) when ``command`` needs the ``train``
    extra and it is not installed."""
    from portarl.cli_train import UsageError, require_train_extra

    try:
        require_train_extra(command)
    except UsageError as err:
        _log(f"portarl {command}: {err}")
        return True
    return False


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
    from portarl.bench.step import main as bench_step

    return _write_bench("step", bench_step, args)


def _cmd_bench_async(args) -> int:
    if _missing_train_extra("bench async"):
        return 2
    from portarl.bench.async_rollout import main as bench_async

    return _write_bench("async", bench_async, args)


def _cmd_export(args) -> int:
    if _missing_train_extra("export"):
        return 2
    from portarl.trainer.progress import quiet_third_party

    quiet_third_party()
    from portarl.export import ExportError, export_checkpoint
    from portarl.lora import LoraUnavailable
    from portarl.trainer.checkpoint import CheckpointError

    from portarl.export import resolve_checkpoint
    from portarl.lora import ADAPTER_WEIGHTS

    try:
        directory = resolve_checkpoint(args.checkpoint)
        out = export_checkpoint(directory, args.out, overwrite=args.overwrite)
    except (ExportError, ValueError, CheckpointError, LoraUnavailable, OSError, RuntimeError) as err:
        _log(f"portarl export: {err}")
        return 2
    what = ("its LoRA adapter merged into the base weights" if (directory / ADAPTER_WEIGHTS).is_file()
            else "full weights")
    print(f"exported {directory} to {out} (a Hugging Face model directory; {what})")
    return 0


def _cmd_eval(args) -> int:
    if _missing_train_extra("eval"):
        return 2
    import json
    from pathlib import Path

    from portarl.trainer.progress import quiet_third_party

    quiet_third_party()
    from portarl.export import ExportError
    from portarl.lora import LoraUnavailable
    from portarl.reward_runner import RewardError
    from portarl.trainer.checkpoint import CheckpointError
    from portarl.trainer.evaluation import eval_checkpoint

    greedy = None if args.greedy is None else args.greedy == "true"
    try:
        metrics = eval_checkpoint(args.checkpoint, args.data, n=args.n, greedy=greedy, max_prompts=args.max_prompts,
                                  device=args.device)
    except (ExportError, ValueError, CheckpointError, LoraUnavailable, RewardError, OSError) as err:
        _log(f"portarl eval: {err}")
        return 2
    text = json.dumps(metrics, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


CHECKPOINT_HELP = ("a checkpoint directory (runs/x/checkpoints/step-000300, runs/x/best/checkpoints/...) or a run's "
                   "output directory (its newest checkpoint)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="portarl", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"portarl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    parity = commands.add_parser(
        "parity",
        help="seeded sweep of every op against float64 on one device (or compare two reports)",
        description="Run every parity case on a device for each backend there and each precision.",
    )
    parity.add_argument("--device", default="auto", help="auto (default), cuda, npu, cpu or e.g. cuda:1")
    parity.add_argument("--out", help="write the JSON report here")
    parity.add_argument("--backends", nargs="+", help="backends to run (default: all usable on the device)")
    parity.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=["fp32", "bf16", "fp16"],
                        help="input precisions to check (default: all three)")
    parity.add_argument("--include-large", action="store_true", help="add the hardware-sized cases (slow without an accelerator)")
    parity.add_argument(
        "--repeats", type=_int_at_least(0), default=None,
        help="timed repetitions per case after one warm-up, median reported (default 3; 0 on CPU, "
        "where interpreted timings mean little)",
    )
    parity.set_defaults(func=_cmd_parity)

    sub = parity.add_subparsers(dest="parity_command")
    compare = sub.add_parser("compare", help="compare two parity reports (e.g. GPU vs Ascend); exit 1 on disagreement")
    compare.add_argument("report_a")
    compare.add_argument("report_b")
    compare.add_argument("--backend-a", help="backend of report A to compare (default: the device's own)")
    compare.add_argument("--backend-b", help="backend of report B to compare (default: the device's own)")
    compare.set_defaults(func=_cmd_compare)

    for name, func, help_text in (
        ("train", cli_train.cmd_train, "GRPO training (no config: the built-in tiny model on arithmetic)"),
        ("sft", cli_train.cmd_sft, "supervised fine-tuning on (prompt, answer) data; saves a model directory"),
    ):
        p = commands.add_parser(name, help=help_text, description=cli_train.DESCRIPTIONS[name])
        cli_train.add_run_arguments(p, name)
        p.set_defaults(func=func)

    from portarl import cli_plan

    pl = commands.add_parser("plan", help="peak memory per device of a training config, before any weights load",
                             description=cli_plan.__doc__.split("\n\n")[0])
    cli_plan.add_arguments(pl)
    pl.set_defaults(func=cli_plan.cmd_plan)

    ex = commands.add_parser("export", help="write a checkpoint as a Hugging Face model directory (LoRA merged in)",
                             description="Write a training checkpoint as a Hugging Face model directory: the model "
                             "rebuilt from the run config saved in it, its weights (a LoRA adapter merged into the "
                             "base weights), and the tokenizer. The checkpoint is verified against its manifest first.")
    ex.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    ex.add_argument("--out", required=True, help="output directory (must be absent or empty unless --overwrite)")
    ex.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    ex.set_defaults(func=_cmd_export)

    ev = commands.add_parser("eval", help="score a checkpoint on held-out prompts with its run's rewards (eval/* metrics)",
                             description="Generate completions for the prompts of --data with a checkpoint's model "
                             "and score them with the rewards of its run config: the eval/* metrics that eval.data "
                             "logs during training, as JSON.")
    ev.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    ev.add_argument("--data", required=True, help="JSONL / Parquet file of prompts and answers (the run's data fields)")
    ev.add_argument("--n", type=int, default=None, help="completions per prompt (default: the run's eval.n; 1 greedy)")
    ev.add_argument("--greedy", choices=["true", "false"], default=None,
                    help="greedy decoding (true) or sampling at the run's temperature (false); default: eval.greedy")
    ev.add_argument("--max-prompts", type=int, default=None, help="evaluate at most this many prompts (0: all)")
    ev.add_argument("--device", default="auto", help="auto (default), cuda, npu or cpu")
    ev.add_argument("--out", help="also write the metrics (JSON) here")
    ev.set_defaults(func=_cmd_eval)

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
    from portarl.bench.stability.cli import add_arguments as _stability_arguments
    from portarl.bench.stability.cli import add_locate_arguments as _locate_arguments

    _stability_arguments(st, st_compare)
    _locate_arguments(st_dump, st_locate)
    sp = bench_cmds.add_parser(
        "step", help="per-step CPU / wall time, phases and peak RSS; --vs trl: TRL's GRPOTrainer on the same work",
        description="Run short GRPO trainings in fresh processes and report the median per-step CPU and wall "
                    "time, the time per phase (rollout, scoring, update) and peak RSS; with --vs trl, TRL's "
                    "GRPOTrainer on the same model, data and batch, rounds alternated.")
    sp.add_argument("--vs", choices=["trl"], help="also run TRL's GRPOTrainer (pip install 'portarl[bench]')")
    sp.add_argument("--steps", type=int, default=6, help="steps per run (fresh process each)")
    sp.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the medians")
    sp.add_argument("--rounds", type=int, default=5, help="rounds; each runs every side once, order alternated")
    sp.add_argument("--threads", type=int, default=1, help="torch / OMP / MKL threads in every run")
    sp.add_argument("--beta", type=float, default=0.0, help="KL weight on both sides (0: no reference model)")
    sp.add_argument("--out", help="JSON output (a .md table is written beside it)")
    sp.set_defaults(func=_cmd_bench_step)
    sa = bench_cmds.add_parser("async", help="rollout.mode colocated vs async: samples/s and reward in the same "
                               "wall-clock budget, beside the ideal overlap")
    sa.add_argument("--config", help="training config (default: the built-in demo)")
    sa.add_argument("--set", action="append", metavar="FIELD=VALUE", help="config override (repeatable)")
    sa.add_argument("--budget-s", type=float, default=60.0, help="seconds of GRPO steps per mode (default 60)")
    sa.add_argument("--threads", type=int, default=1, help="torch / OMP threads per process (default 1)")
    sa.add_argument("--work-dir", help="where the runs go (default: a temporary directory)")
    sa.add_argument("--reuse", action="store_true", help="no new runs: report on those already in --work-dir")
    sa.add_argument("--out", help="JSON output (a .md table is written beside it)")
    sa.set_defaults(func=_cmd_bench_async)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = {}
    if args.func is cli_train.cmd_train and threading.current_thread() is threading.main_thread():
        # SIGINT / SIGTERM before training starts: a clean exit, recorded so that training
        # cannot start after one (trainer/signals.py). Restored on return, so a caller that
        # runs main() in-process (tests, notebooks) keeps its own handlers.
        from portarl.startup_signals import clear_startup_signals, startup_handler

        clear_startup_signals()
        previous = {s: signal.signal(s, startup_handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = args.func(args)
    except KeyboardInterrupt as err:  # Ctrl-C / SIGTERM during imports or set-up: no traceback
        _log(f"portarl {args.command}: interrupted during start-up ({err or 'SIGINT'}); nothing was saved")
        code = 128 + int(getattr(err, "signum", 2))
    except Exception:
        if not _joined_a_job():
            raise
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if _joined_a_job():  # a torchrun rank: leave without interpreter finalisation (exit_path.py)
        from portarl.exit_path import leave_process

        leave_process(code)
    return code


def _joined_a_job() -> bool:
    """Without importing torch (``portarl --help`` stays fast): only a process that imported
    portarl.distributed can have joined a torchrun job."""
    pdist = sys.modules.get("portarl.distributed")
    return pdist is not None and pdist.joined_a_job()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
