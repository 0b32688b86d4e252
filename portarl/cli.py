"""The ``portarl`` command line.

    portarl parity [--device auto|cuda|npu|cpu] [--out report.json] [--backends ...]
                   [--dtypes ...] [--include-large] [--repeats N]
    portarl parity compare A.json B.json [--backend-a NAME] [--backend-b NAME]
    portarl train [--config FILE.yaml] [--set key=value ...] [--device D] [--output-dir DIR] [--resume]
    portarl sft   [--config FILE.yaml] [--set key=value ...] [--device D] [--output-dir DIR] [--steps N]
    portarl bench step [--vs trl] [--steps N] [--rounds R] [--threads T] [--out FILE.json]

Exit status: 0 on success, 1 when a parity check fails, 2 for bad usage, a bad config or
an unusable device, 3 when training stopped itself (persistent non-finite values; a
checkpoint was saved), 130 on Ctrl-C (after saving a checkpoint).
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


def _load_train_config(args):
    from portarl.trainer.config import ConfigError, TrainConfig

    overrides = list(args.set or [])
    if args.device:
        overrides.append(f"device={args.device}")
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    try:
        return TrainConfig.load(args.config, overrides)
    except ConfigError as err:
        _log(f"portarl {args.command}: config error: {err}")
        return None


def _setup_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _cmd_train(args) -> int:
    config = _load_train_config(args)
    if config is None:
        return 2
    _setup_logging()
    from portarl.device import DeviceUnavailableError
    from portarl.trainer import GRPOTrainer, TrainingStopped, build_from_config

    try:
        model, tokenizer, examples = build_from_config(config)
        trainer = GRPOTrainer(model, tokenizer, None, examples, config, device=config.device)
    except (DeviceUnavailableError, ValueError, FileNotFoundError) as err:
        _log(f"portarl train: {err}")
        return 2
    _log(f"portarl train: {config.model.path} model on {trainer.device}, output in {config.output_dir}")
    from portarl import distributed as pdist

    try:
        result = trainer.train(resume=args.resume)
    except TrainingStopped as err:
        _log(f"portarl train: {err}")
        return 3
    except KeyboardInterrupt:
        _log("portarl train: interrupted; checkpoint saved, continue with --resume")
        return 130
    finally:
        trainer.close()
        pdist.shutdown()
    if not trainer.dist.is_main:
        return 0
    print(result.summary)
    print(f"metrics: {config.output_dir}/metrics.jsonl   checkpoint: {result.checkpoint}")
    return 0


def _cmd_sft(args) -> int:
    config = _load_train_config(args)
    if config is None:
        return 2
    _setup_logging()
    from portarl.device import resolve_device
    from portarl.models import save_local
    from portarl.tokenizer import as_codec
    from portarl.trainer import build_from_config
    from portarl.trainer.sft import run_sft

    model, tokenizer, examples = build_from_config(config)
    device = resolve_device(config.device)
    model.to(device)
    steps = args.steps or config.train.sft_warmup_steps or 100
    losses = run_sft(model, as_codec(tokenizer), examples, steps=steps, batch_size=config.train.sft_batch_size,
                     lr=config.train.sft_lr, device=device, seed=config.train.seed,
                     on_step=lambda i, loss: _log(f"sft step {i}/{steps}: loss {loss:.4f}") if i % 10 == 0 else None)
    out = f"{config.output_dir}/sft-model"
    save_local(model, tokenizer, out)
    print(f"sft: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} steps; model saved to {out} "
          f"(train on it with --set model.path={out})")
    return 0


def _device_slug(name: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def _cmd_bench_kernels(args) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from portarl.device import DeviceUnavailableError, resolve_device

    try:
        device = resolve_device(args.device)
    except (DeviceUnavailableError, ValueError) as err:
        _log(f"portarl bench kernels: {err}")
        return 2
    from portarl import envinfo
    from portarl.bench.kernels import QUICK_SHAPES, markdown_table, run_kernels

    env = envinfo.environment(device)
    shapes = QUICK_SHAPES if args.quick else None
    results, bandwidth = run_kernels(device, shapes=shapes, dtypes=args.dtypes, repeats=args.repeats, progress=_log)
    table = markdown_table(results, env["device_name"], bandwidth)
    print(table)
    out = Path(args.out) if args.out else Path("bench/results") / f"kernels-{_device_slug(env['device_name'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "copy_bandwidth_bytes_per_s": bandwidth,
                               "results": [dataclasses.asdict(r) for r in results]}, indent=1) + "\n")
    out.with_suffix(".md").write_text(f"# Kernel benchmarks: {env['device_name']}\n\n" + table)
    print(f"written: {out} and {out.with_suffix('.md')}")
    return 0


def _cmd_bench_stability(args) -> int:
    from portarl.bench.stability import parse_runs, run_stability
    from portarl.trainer.config import ConfigError

    try:
        specs = parse_runs(args.runs)
    except ValueError as err:
        _log(f"portarl bench stability: {err}")
        return 2
    _setup_logging()
    import logging

    logging.getLogger("portarl.train").setLevel(logging.ERROR)  # events go to the report
    try:
        analysis, report = run_stability(
            specs, steps=args.steps, seed=args.seed, config_path=args.config, overrides=args.set or [],
            out_dir=args.out, replay=args.replay_rollouts, threshold=args.threshold, progress=_log,
        )
    except ConfigError as err:
        _log(f"portarl bench stability: config error: {err}")
        return 2
    for run in analysis["runs"]:
        print(run["verdict"])
    print(f"report: {report}")
    return 0


def _cmd_bench_step(args) -> int:
    import json
    from pathlib import Path

    from portarl.bench.step import main as bench_step

    try:
        result, table = bench_step(args, progress=_log)
    except RuntimeError as err:
        _log(f"portarl bench step: {err}")
        return 2
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(table)
        print(f"written: {out} and {out.with_suffix('.md')}")
    return 0


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

    for name, func, help_text in (
        ("train", _cmd_train, "GRPO training (no config: the built-in tiny model on arithmetic)"),
        ("sft", _cmd_sft, "supervised fine-tuning on (prompt, answer) data; saves a model directory"),
    ):
        p = commands.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", help="YAML config (sections: model, data, rollout, rewards, train, optim, ...)")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field, e.g. train.steps=10")
        p.add_argument("--device", help="auto, cuda, npu or cpu (overrides the config)")
        p.add_argument("--output-dir", help="where metrics, TensorBoard logs and checkpoints go")
        if name == "train":
            p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
        else:
            p.add_argument("--steps", type=int, help="SFT steps (default: train.sft_warmup_steps or 100)")
        p.set_defaults(func=func)

    bench = commands.add_parser("bench", help="kernel speed / memory, and training stability across settings")
    bench_cmds = bench.add_subparsers(dest="bench_command", required=True)
    k = bench_cmds.add_parser("kernels", help="logprobs and kl: portarl backends vs eager, row loop, Liger")
    k.add_argument("--device", default="auto")
    k.add_argument("--out", help="JSON output (a .md table is written beside it); default bench/results/kernels-<device>.json")
    k.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32", "fp16"])
    k.add_argument("--repeats", type=int, default=5)
    k.add_argument("--quick", action="store_true", help="one tiny shape (smoke test)")
    k.set_defaults(func=_cmd_bench_kernels)
    st = bench_cmds.add_parser("stability", help="train one config under several settings and compare the runs")
    st.add_argument("--runs", default="cpu:fp32,cpu:bf16,cpu:bf16:npu-emulated",
                    help="comma-separated device:dtype[:backend-or-profile], e.g. cuda:bf16,npu:bf16 or cpu:bf16:npu-emulated")
    st.add_argument("--steps", type=int, default=100)
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--config", help="training config YAML (default: the built-in demo config)")
    st.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override for every run")
    st.add_argument("--out", default="bench/results/stability", help="output directory (report.md, stability.png, stability.json)")
    st.add_argument("--replay-rollouts", action="store_true",
                    help="record the first run's rollouts and feed them to the others (isolates trainer numerics)")
    st.add_argument("--threshold", type=float, default=0.1, help="parting threshold, as a fraction of a metric's typical size")
    st.set_defaults(func=_cmd_bench_stability)
    sp = bench_cmds.add_parser("step", help="per-step CPU / wall time, phases and peak RSS; --vs trl: TRL's GRPOTrainer on the same work")
    sp.add_argument("--vs", choices=["trl"], help="also run TRL's GRPOTrainer (pip install 'portarl[bench]')")
    sp.add_argument("--steps", type=int, default=6, help="steps per run (fresh process each)")
    sp.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the medians")
    sp.add_argument("--rounds", type=int, default=5, help="rounds; each runs every side once, order alternated")
    sp.add_argument("--threads", type=int, default=1, help="torch / OMP / MKL threads in every run")
    sp.add_argument("--beta", type=float, default=0.0, help="KL weight on both sides (0: no reference model)")
    sp.add_argument("--out", help="JSON output (a .md table is written beside it)")
    sp.set_defaults(func=_cmd_bench_step)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (getattr(args, "repeats", None) or 0) < 0:
        build_parser().error("--repeats must be >= 0")
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
