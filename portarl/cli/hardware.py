"""``portarl hardware-check``: the device acceptance run (:mod:`portarl.bench.hardware`)."""

from __future__ import annotations

import sys
from pathlib import Path

STAGE_HELP = "environment, parity, kernels, training, step, hardware-tests"


def add_parser(commands) -> None:
    p = commands.add_parser(
        "hardware-check",
        help="one prepared command on a GPU / NPU (or the CPU): environment, parity, kernels, training",
        description="Check a device in stages, each in a process of its own with a time limit: the environment "
                    "(measured copy bandwidth and bf16 matmul), every op of every backend there against float64 (the "
                    "parity report), the fused ops at RL shapes against eager, torch.compile and Liger, GRPO in bf16 "
                    "and fp16 with activation checkpointing, padding-free rows, fused AdamW and FSDP2 on one device "
                    "(with its stability record), and the hardware-marked tests. Writes at most 8 files to --out "
                    "(summary.md first). Runs from the project's tree with PYTHONPATH alone (docs/hardware-ci.md).",
        epilog="exit status: 0 every stage passed; 1 a stage failed, ran past its limit or could not run (one line "
               "on stderr names it; summary.md has all); 2 bad usage.")
    p.add_argument("--device", required=True, help="cuda, npu or cpu (or e.g. cuda:1)")
    p.add_argument("--out", required=True, help="output folder (new or empty; at most 8 files are written)")
    p.add_argument("--quick", action="store_true",
                   help="every stage on small shapes (CI runs it on the CPU; the CPU always runs this size)")
    p.add_argument("--stages", nargs="+", metavar="STAGE", default=None,
                   help=f"run only these stages (default: all, in order: {STAGE_HELP})")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole check (default: 480 on a GPU / NPU, 900 quick); each stage also has "
                        "its own limit")
    p.add_argument("--work", default=None,
                   help="keep the scratch runs here (the stability run directory, the FSDP2 run, pytest's XML); "
                        "default: a temporary folder, removed at the end")
    p.set_defaults(func=cmd_hardware_check)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_hardware_check(args) -> int:
    from portarl.bench.hardware.check import run_check
    from portarl.bench.hardware.plan import STAGES, make_plan

    try:
        plan = make_plan(args.device, quick=args.quick, total_s=args.budget_s)
    except ValueError as err:
        _log(f"portarl hardware-check: {err}")
        return 2
    stages = tuple(args.stages or STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        _log(f"portarl hardware-check: --stages {' '.join(unknown)}: choose from {STAGE_HELP}")
        return 2
    if args.budget_s is not None and args.budget_s <= 0:
        _log(f"portarl hardware-check: --budget-s {args.budget_s}: give a positive number of seconds")
        return 2
    import signal

    def stop(signum, frame):  # SIGTERM as Ctrl-C: the running stage's processes are stopped on the way out
        raise KeyboardInterrupt(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return run_check(plan, Path(args.out), stages=stages, work=Path(args.work) if args.work else None)
    except FileExistsError as err:
        _log(f"portarl hardware-check: {err}")
        return 2
    except KeyboardInterrupt as err:
        signum = err.args[0] if err.args and isinstance(err.args[0], int) else signal.SIGINT
        _log(f"portarl hardware-check: stopped by {signal.Signals(signum).name}; the running stage was stopped "
             f"with it (what finished is in {Path(args.out) / 'summary.md'})")
        return 128 + int(signum)
    finally:
        signal.signal(signal.SIGTERM, previous)
