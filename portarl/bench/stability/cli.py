"""``portarl bench stability`` (record, or replay with ``--replay-from``) and
``portarl bench stability compare`` handlers, kept here so ``portarl/cli/main.py`` only wires
arguments."""

from __future__ import annotations

import logging
import sys


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_arguments(st, compare_parser) -> None:
    """The options this package adds to ``bench stability`` and its ``compare`` subcommand."""
    st.add_argument("--replay-from", metavar="DIR",
                    help="replay the rollouts recorded in DIR (a --replay-rollouts output made on any machine, or a "
                         ".tar of one: bench stability pack), from its start model and config; refused when config, "
                         "data order, seeds or prompts differ")
    st.add_argument("--noise-floor", action="store_true",
                    help="also train the first setting with train.seed+1: a run parts only beyond that gap")
    compare_parser.add_argument("dirs", nargs="+", metavar="DIR",
                                help="stability run directories, or .tar files of them (first: baseline)")
    compare_parser.add_argument("--out", dest="compare_out", metavar="DIR", default="stability-compare",
                                help="report directory (report.md, stability.png, tokens.png, stability.json)")
    compare_parser.add_argument("--threshold", dest="compare_threshold", metavar="FRACTION", type=float, default=0.1,
                                help="parting threshold, as a fraction of a metric's typical size")


def add_pack_arguments(pack_parser) -> None:
    """``bench stability pack DIR [--out FILE.tar]``."""
    pack_parser.add_argument("pack_dir", metavar="DIR", help="stability output directory")
    pack_parser.add_argument("--out", dest="pack_out", metavar="FILE",
                             help="archive to write: .tar, or .tar.gz / .tgz for gzip (default: DIR.tar)")


def add_locate_arguments(dump_parser, locate_parser) -> None:
    """``bench stability dump`` and ``bench stability locate``."""
    dump_parser.add_argument("--from", dest="dump_from", metavar="DIR", required=True,
                             help="stability directory that recorded its rollouts (--replay-rollouts), or one that "
                                  "replayed them; or a .tar of one")
    dump_parser.add_argument("--step", dest="dump_step", type=int, required=True, metavar="S",
                             help="the step to dump (steps 1..S-1 are trained here on the recorded rollouts first)")
    dump_parser.add_argument("--out", dest="dump_out", metavar="DIR", required=True, help="dump directory")
    dump_parser.add_argument("--run", dest="dump_run", metavar="SPEC",
                             help="setting on this machine, as a --runs entry (default: the directory's own run), "
                                  "e.g. npu:bf16 or cpu:bf16:npu-emulated")
    dump_parser.add_argument("--modules", dest="dump_modules", nargs="+", metavar="PATTERN",
                             help="only these modules: globs or prefixes, e.g. 'model.layers.7' 'portarl.*'")
    dump_parser.add_argument("--budget-mb", dest="dump_budget_mb", type=float, default=1024.0, metavar="MB",
                             help="full tensors (activations, weights, grads) kept up to this size, in call order; summaries for all (0: summaries only, culprits found by CRC-32 alone)")
    dump_parser.add_argument("--rows", dest="dump_rows", type=int, metavar="N",
                             help="sequences of the step's first micro-batch to run (default: the whole micro-batch)")
    locate_parser.add_argument("dumps", nargs=2, metavar="DUMP", help="two dump directories (A: reference, B: other)")
    locate_parser.add_argument("--out", dest="locate_out", metavar="DIR", default="locate",
                               help="report directory (locate.md, locate.json, locate.png)")


def _guarded(command: str, call, errors: tuple):
    """``(call(), None)``, or ``(None, 2)`` after one line saying what is wrong with the input."""
    from portarl.trainer.config import ConfigError

    try:
        return call(), None
    except ConfigError as err:
        _log(f"portarl {command}: config error: {err}")
    except errors as err:
        _log(f"portarl {command}: {err}")
    return None, 2


def cmd_dump(args) -> int:
    from portarl.bench.stability.archive import open_record
    from portarl.bench.stability.dump_step import dump_recorded_step
    from portarl.rollout.replay import RolloutFileError

    if args.dump_budget_mb < 0:
        _log(f"portarl bench stability dump: --budget-mb {args.dump_budget_mb}: give 0 (summaries only) or more")
        return 2
    logging.getLogger("portarl.train").setLevel(logging.ERROR)

    def dump():
        with open_record(args.dump_from) as source:
            return dump_recorded_step(source, args.dump_step, args.dump_out, run=args.dump_run,
                                      modules=args.dump_modules, budget_mb=args.dump_budget_mb, rows=args.dump_rows,
                                      progress=_log)

    index, failed = _guarded("bench stability dump", dump, (FileNotFoundError, ValueError, RolloutFileError))
    if failed:
        return failed
    print(f"dump: {index.parent}")
    return 0


def cmd_locate(args) -> int:
    from portarl.bench.stability.locator import locate
    from portarl.bench.stability.locate_report import write_locate_report

    try:
        result = locate(*args.dumps)
    except (FileNotFoundError, ValueError, KeyError) as err:
        _log(f"portarl bench stability locate: {err}")
        return 2
    report = write_locate_report(result, args.locate_out)
    print(result["verdict"])
    print(f"report: {report}")
    return 0


def cmd_stability(args) -> int:
    from portarl.bench.stability import ReplayMismatch, parse_runs, run_stability
    from portarl.bench.stability.runs import check_run_devices

    command = getattr(args, "stability_command", None)
    if command in ("compare", "dump", "locate", "pack"):
        return {"compare": cmd_compare, "dump": cmd_dump, "locate": cmd_locate, "pack": cmd_pack}[command](args)
    try:
        specs = parse_runs(args.runs)
        check_run_devices(specs)
    except ValueError as err:
        _log(f"portarl bench stability: {err}")
        return 2
    logging.getLogger("portarl.train").setLevel(logging.ERROR)  # events go to the report
    done, failed = _guarded("bench stability", lambda: run_stability(
        specs, steps=args.steps, seed=args.seed, config_path=args.config, overrides=args.set or [],
        out_dir=args.out, replay=args.replay_rollouts, replay_from=args.replay_from,
        noise_floor=args.noise_floor, threshold=args.threshold, progress=_log,
    ), (ReplayMismatch, FileNotFoundError, ValueError))
    if failed:
        return failed
    analysis, report = done
    print_verdicts(analysis)
    print(f"report: {report}")
    return 0


def print_verdicts(analysis: dict) -> None:
    """Each run's verdict, and under it its mean relative loss gap to the baseline."""
    for run in analysis["runs"]:
        print(run["verdict"])
        if run.get("loss_gap"):
            print(f"  {run['label']}: {run['loss_gap']['line']}")


def cmd_pack(args) -> int:
    """One file for a stability directory (a machine that returns few files returns it whole)."""
    from pathlib import Path

    from portarl.bench.stability.archive import pack_record

    out = args.pack_out or str(Path(args.pack_dir).resolve()) + ".tar"
    try:
        path = pack_record(args.pack_dir, out)
    except (FileNotFoundError, ValueError) as err:
        _log(f"portarl bench stability pack: {err}")
        return 2
    print(f"packed: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


def cmd_compare(args) -> int:
    """Exit 1 when a run parts from the baseline (CI gates on it), 2 on unreadable input
    (an unsafe or damaged .tar included). The mean relative loss gap is printed under each
    verdict and does not change the exit status."""
    from portarl.bench.stability import compare

    try:
        analysis, report = compare(args.dirs, args.compare_out, threshold=args.compare_threshold)
    except (FileNotFoundError, ValueError, KeyError) as err:
        _log(f"portarl bench stability compare: {err}")
        return 2
    print_verdicts(analysis)
    print(f"report: {report}")
    if analysis["parted"]:
        print(f"parted from {analysis['baseline']}: {', '.join(analysis['parted'])}")
        return 1
    return 0
