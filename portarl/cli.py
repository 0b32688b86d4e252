"""The ``portarl`` command line.

    portarl parity [--device auto|cuda|npu|cpu] [--out report.json] [--backends ...]
                   [--dtypes ...] [--include-large] [--repeats N]
    portarl parity compare A.json B.json [--backend-a NAME] [--backend-b NAME]

Exit status: 0 when every check passes, 1 when a check fails, 2 for bad usage (argparse)
or an unusable device.
"""

from __future__ import annotations

import argparse
import os
import sys


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="portarl", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    parity = commands.add_parser(
        "parity",
        help="seeded sweep of every op against float64 on one device (or compare two reports)",
        description="Run every parity case on a device for each backend there and each precision.",
    )
    parity.add_argument("--device", default="auto", help="auto (default), cuda, npu, cpu or e.g. cuda:1")
    parity.add_argument("--out", help="write the JSON report here")
    parity.add_argument("--backends", nargs="+", help="backends to run (default: all usable on the device)")
    parity.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=["fp32", "bf16", "fp16"])
    parity.add_argument("--include-large", action="store_true", help="add the hardware-sized cases (slow without an accelerator)")
    parity.add_argument(
        "--repeats", type=int, default=None,
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (getattr(args, "repeats", None) or 0) < 0:
        build_parser().error("--repeats must be >= 0")
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
