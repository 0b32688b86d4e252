"""One process of a weight-sync test group: ``sender`` (rank 0) or ``receiver`` (rank >= 1).

The sender publishes versions 1..N of :func:`version_tensors` (deterministic, so the test
recomputes them) and writes its port to ``<out>/port``; each receiver saves every version it
loaded to ``<out>/rank<r>/v<version>.safetensors``, and on a torn version writes
``torn.json`` and the weights it kept. Both end with ``os._exit`` (Gloo's threads must not
race interpreter finalisation: portarl.runtime.exit_path).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from portarl.rollout.weight_sync import SyncGroup, TornVersion, WeightReceiver, WeightSender


def version_tensors(version: int, big_mb: float = 0.0) -> list[tuple[str, torch.Tensor]]:
    """A model-like mix of fp32 / bf16 / fp16 tensors (and an int buffer), with the bit
    patterns a lossy path would change: -0.0, inf, NaN with a payload, subnormals."""
    g = torch.Generator().manual_seed(1000 + version)
    items = [("embed.weight", torch.randn(300, 64, generator=g).to(torch.bfloat16))]
    if big_mb:
        items.append(("big.weight", torch.randn(int(big_mb * 2**20) // 4, generator=g)))
    for layer in range(3):
        items += [
            (f"layers.{layer}.attn.weight", torch.randn(64, 96, generator=g).to(torch.bfloat16)),
            (f"layers.{layer}.norm.weight", torch.randn(64, generator=g)),
            (f"layers.{layer}.mlp.weight", torch.randn(96, 64, generator=g).to(torch.float16).t()),  # non-contiguous
        ]
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -3e-42, 1.0, version], dtype=torch.float32)
    nan_payload = torch.tensor([0x7FC00001 + version, 0x7F800001], dtype=torch.int32).view(torch.float32)
    items += [("special", special), ("nan_payload", nan_payload), ("scale", torch.tensor(0.5 * version)),
              ("positions", torch.arange(10, dtype=torch.int64) * version),
              ("fp16_subnormal", torch.tensor([6e-8, -6e-8, 65504.0], dtype=torch.float16))]
    return items


def _port(out: Path) -> int:
    while not (out / "port").exists():
        time.sleep(0.05)
    return int((out / "port").read_text())


def _comm(args) -> dict:
    """The data plane: Gloo, or NCCL / HCCL over the stand-in of vLLM's communicator
    (:mod:`standin_vllm`, on the CPU: not a hardware test)."""
    if args.comm == "gloo":
        return {}
    import standin_vllm

    standin_vllm.install(args.out)
    return {"comm": args.comm, "device": "cpu"}


def _started(out: Path, world: int) -> None:
    """The harness's start barrier (no deadline: the test's own limit bounds it): the sender
    opens the group only once every receiver's process has imported what it needs, so that
    a receiver slowed by a loaded machine before it could join is not taken for one that
    never starts (the group gives a rank that never beats ``stale_after_s``)."""
    while not all((out / f"started{r}").exists() for r in range(1, world)):
        time.sleep(0.05)


def _transfer_entered(out: Path, rank: int) -> Path:
    return out / f"transfer{rank}"


def _mark_transfers(group, out: Path, rank: int) -> None:
    """Receiver side of the kill gate: before taking part in a bucket's transfer, say which
    (the sender's gate waits for every receiver to be inside the bucket it dies in)."""
    broadcast = group.broadcast

    def marked(flat, peers, what):
        tmp = _transfer_entered(out, rank).with_suffix(".tmp")
        tmp.write_text(what)
        os.replace(tmp, _transfer_entered(out, rank))
        return broadcast(flat, peers, what)

    group.broadcast = marked


def _kill_inside_the_transfer(group, out: Path, world: int) -> dict:
    """Sender side of the kill gate. Once ``armed`` holds ``(index, version)``, the next
    broadcast is not started: the sender waits until every receiver has read that bucket's
    header and entered its transfer, then SIGKILLs itself. A gate, not a timer (issue 58):
    the 50 ms delay after the bucket was packed that this replaces was a 2x margin over a
    ~0.1 s transfer, which a fast machine can finish first and a loaded one can reach
    before any receiver read the header. No deadline: the test's limit bounds the wait."""
    armed, start = {}, group.start_broadcast

    def start_or_die(flat):
        if armed:
            want = f"the transfer of bucket {armed['index']} of version {armed['version']}"
            while not all(_transfer_entered(out, r).exists() and _transfer_entered(out, r).read_text() == want
                          for r in range(1, world)):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        return start(flat)

    group.start_broadcast = start_or_die
    return armed


def sender(args) -> int:
    _started(Path(args.out), args.world)
    group = SyncGroup("127.0.0.1", 0, 0, args.world, timeout_s=args.timeout_s, stale_after_s=args.stale_after_s,
                      **_comm(args))
    tmp = Path(args.out) / "port.tmp"
    tmp.write_text(str(group.port))
    os.replace(tmp, Path(args.out) / "port")
    sync = WeightSender(group, bucket_mb=args.bucket_mb, checksum=args.checksum)
    log = open(Path(args.out) / "sender.jsonl", "a")
    armed = _kill_inside_the_transfer(group, Path(args.out), args.world)
    for version in range(1, args.versions + 1):

        def on_bucket(index, names, version=version):
            if version == args.kill_in and "big.weight" in names:  # SIGKILL this process mid-bucket
                (Path(args.out) / "killed_in_bucket").write_text(str(index))
                armed.update(index=index, version=version)
            if args.pause_s and index == 1:
                time.sleep(args.pause_s)  # a slow sender between two buckets (alive, beating)

        stats = sync.send(version, iter(version_tensors(version, args.big_mb if version == args.kill_in else 0)),
                          on_bucket=on_bucket)
        log.write(json.dumps(stats.as_dict()) + "\n")
        log.flush()
    group.close()
    return 0


def receiver(args) -> int:
    out = Path(args.out) / f"rank{args.rank}"
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    comm = _comm(args)
    (Path(args.out) / f"started{args.rank}").write_text("")
    group = SyncGroup("127.0.0.1", _port(Path(args.out)), args.rank, args.world, timeout_s=args.timeout_s,
                      stale_after_s=args.stale_after_s, **comm)
    _mark_transfers(group, Path(args.out), args.rank)
    sync, kept = WeightReceiver(group), {}

    def load(version, tensors):  # what a rollout engine does with a version that arrived whole
        kept.clear()
        kept.update(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"v{version}.safetensors"))

    for _ in range(args.versions):
        start = time.monotonic()
        try:
            sync.receive(load)
        except TornVersion as err:
            seconds = time.monotonic() - start
            save_file({k: v.contiguous() for k, v in kept.items()}, str(out / "kept.safetensors"))
            (out / "torn.json").write_text(json.dumps({"version": err.version, "kept": err.kept, "seconds": seconds,
                                                       "loaded": sync.version, "message": str(err)}))
            return 3
    group.close()
    return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["sender", "receiver"])
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=0.0625)
    p.add_argument("--checksum", action="store_true")
    p.add_argument("--kill-in", type=int, default=0, help="version in whose big bucket the sender SIGKILLs itself")
    p.add_argument("--big-mb", type=float, default=64.0, help="size of the bucket the sender is killed in")
    p.add_argument("--pause-s", type=float, default=0.0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--stale-after-s", type=float, default=None)
    p.add_argument("--comm", choices=["gloo", "nccl", "hccl"], default="gloo")
    args = p.parse_args()
    code = 1
    try:
        code = sender(args) if args.role == "sender" else receiver(args)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
