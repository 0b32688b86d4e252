"""The ``portarl`` command line.

    portarl parity [--device auto|cuda|npu|cpu] [--out report.json] [--backends ...]
                   [--dtypes ...] [--include-large] [--repeats N]
    portarl parity compare A.json B.json [--backend-a NAME] [--backend-b NAME]
    portarl train [--config FILE.yaml] [--set key=value ...] [--device D] [--output-dir DIR] [--steps N]
                  [--resume | --overwrite]
    portarl sft   [--config FILE.yaml] [--set key=value ...] [--device D] [--output-dir DIR] [--steps N] [--overwrite]
    portarl export --checkpoint C --out DIR [--overwrite]
    portarl episodes RUN [--step N] [--sample K] [--ids] [--tokens]
    portarl plan  [--config FILE.yaml] [--set key=value ...] [--devices N] [--device-memory 80GiB]
    portarl bench kernels | stability [compare | dump | locate | pack] ...
    portarl bench step [--vs trl] [--steps N] [--rounds R] [--threads T] [--out FILE.json]
    portarl bench memory [--config FILE.yaml] [--set key=value ...] [--nproc N]
    portarl --version

Exit status: 0 on success, 1 when a parity check fails or ``plan`` says the run does not fit, 2 for bad usage, a bad config, an
output directory holding another run, a model directory or data that cannot be used, an
unusable device, no checkpoint that verifies on --resume, or a missing / incomplete /
damaged checkpoint or a non-empty --out for export (one line on stderr, no
traceback), 3 when training stopped itself (persistent non-finite values; a checkpoint was
saved), 4 when a file of the run could not be written, 5 when the run's process exited without
finishing (user or native code called os._exit or exit()), 75 when another torchrun rank
stopped answering, 128 + the signal number on SIGINT (130) or SIGTERM (143): after the current
step and a checkpoint on the first signal, at once on a second (the message says whether a
checkpoint exists for the last step); 128 + the signal number too when the run's process was
killed (a segfault, the OOM killer). ``train``, ``sft`` and ``eval`` run in a child process that
a supervising parent waits for (:mod:`portarl.runtime.supervisor`): exit 0 only when the child finished.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from portarl import __version__
from portarl.runtime import blackbox
from portarl.cli import train as cli_train
from portarl.cli import bench as cli_bench
from portarl.cli.common import _int_at_least, _log, _missing_train_extra

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
  portarl hardware-check --device cuda --out hw   a GPU's acceptance run (docs/hardware-ci.md)

exit status: 0 ok (train: the last step finished and was saved), 1 parity disagreement,
2 bad usage / config / input (one line on stderr), 3 training stopped itself (a checkpoint was
saved), 4 a file of the run could not be written (disk full, a file-size limit, no permission),
5 the run's process exited without finishing (os._exit / exit() in user or native code),
75 another torchrun rank stopped answering, 130 / 143 on SIGINT / SIGTERM, 128 + signal when
the run's process was killed (139 a segfault, 137 SIGKILL: the OOM killer). Every non-zero
exit of train, sft and eval ends with one line saying why and what to run next."""

#: Where ``bench`` writes by default: beside the training runs, not into the committed
#: ``bench/results/`` (a run in the repository root used to overwrite the committed table).


def _prepare_interpreter(device) -> None:
    """On CPU, build the Triton kernels for the interpreter so the cuda backend is checked too.

    Must happen before :mod:`portarl.kernels` is imported (triton decides at decoration time).
    """
    if device.type == "cpu" and "portarl.kernels" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _cmd_parity(args) -> int:
    import torch  # noqa: F401  (imported here so `portarl --help` stays fast)

    from portarl.backends.device import DeviceUnavailableError, resolve_device

    try:
        device = resolve_device(args.device)
    except (DeviceUnavailableError, ValueError) as err:
        _log(f"portarl parity: {err}")
        return 2
    _prepare_interpreter(device)

    from portarl.backends import envinfo
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


def _cmd_export(args) -> int:
    if _missing_train_extra("export"):
        return 2
    from portarl.trainer.run.progress import quiet_third_party

    quiet_third_party()
    from portarl.trainer.checkpoint.export import ExportError, export_checkpoint
    from portarl.assets.lora import LoraUnavailable
    from portarl.trainer.checkpoint import CheckpointError

    from portarl.trainer.checkpoint.export import resolve_checkpoint
    from portarl.assets.lora import ADAPTER_WEIGHTS

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

    from portarl.trainer.run.progress import quiet_third_party

    quiet_third_party()
    from portarl.trainer.checkpoint.export import ExportError
    from portarl.assets.lora import LoraUnavailable
    from portarl.assets.reward_runner import RewardError
    from portarl.trainer.checkpoint import CheckpointError
    from portarl.trainer.phases.evaluation import eval_checkpoint

    greedy = None if args.greedy is None else args.greedy == "true"
    blackbox.note(phase="eval")  # what a supervising parent names if the process dies (portarl/runtime/supervisor.py)
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

    from portarl.cli import plan as cli_plan

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

    cli_bench.add_parser(commands)
    from portarl.cli import episodes as cli_episodes

    cli_episodes.add_parser(commands)  # portarl episodes RUN: samples.jsonl turn by turn, token ids and loss mask
    from portarl.cli import hardware as cli_hardware

    cli_hardware.add_parser(commands)  # portarl hardware-check: a lent GPU / an Ascend host in one command
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed: `train` names its own resume command
    from portarl.runtime import supervisor

    parent = supervisor.Supervisor.for_command(args, argv)  # train, sft, eval: run by a child it supervises
    if parent is not None and not parent.fork():
        return parent.wait()
    previous = {}
    if args.func is cli_train.cmd_train and threading.current_thread() is threading.main_thread():
        # SIGINT / SIGTERM before training starts: a clean exit, recorded so that training
        # cannot start after one (trainer/run/signals.py). Restored on return, so a caller that
        # runs main() in-process (tests, notebooks) keeps its own handlers.
        from portarl.runtime.startup_signals import clear_startup_signals, startup_handler

        clear_startup_signals()
        previous = {s: signal.signal(s, startup_handler) for s in (signal.SIGINT, signal.SIGTERM)}
    groups_before = _sync_groups_built()
    try:
        code = args.func(args)
    except KeyboardInterrupt as err:  # Ctrl-C / SIGTERM during imports or set-up: no traceback
        _log(f"portarl {args.command}: interrupted during start-up ({err or 'SIGINT'}); nothing was saved")
        code = 128 + int(getattr(err, "signum", 2))
    except Exception:
        if not _joined_a_job():
            blackbox.declare(1)  # Python's traceback says why, exit 1
            raise
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    blackbox.declare(code)  # this exit said why (a supervising parent passes it through)
    if code and args.command == "train" and not _joined_a_job() and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        # A rank of a job on several nodes that stopped before joining: the other nodes would
        # wait for it in init_process_group for distributed.timeout_s (runtime/heartbeat.py).
        from portarl.runtime.heartbeat import announce_startup_failure

        announce_startup_failure(code)
    # A torchrun rank, or the command line (not an in-process caller) that built a weight-sync
    # group: leave without interpreter finalisation (exit_path.py).
    if _joined_a_job() or (argv is None and _sync_groups_built() > groups_before):
        from portarl.runtime.exit_path import leave_process

        leave_process(code)
    return code


def _joined_a_job() -> bool:
    """Without importing torch (``portarl --help`` stays fast): only a process that imported
    portarl.runtime.distributed can have joined a torchrun job."""
    pdist = sys.modules.get("portarl.runtime.distributed")
    return pdist is not None and pdist.joined_a_job()


def _sync_groups_built() -> int:
    """How many weight-sync communicators this process built (``rollout.weight_sync:
    collective``): their Gloo threads outlive them as a torchrun job's do, so a command
    that built one leaves the same way."""
    comm = sys.modules.get("portarl.rollout.weight_sync.device_comm")
    return 0 if comm is None else comm.groups_built()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
