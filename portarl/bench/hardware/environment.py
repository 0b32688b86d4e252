"""Stage 1: what the device is, and the two figures the kernel numbers are read against.

The measured device-to-device copy bandwidth is the roofline of the memory-bound ops
(log-softmax-gather reads its logits once: its time can at best be the bytes over the copy
bandwidth); the bf16 matmul throughput is the roofline of the fused linear log-probs. Both
are measured here, on this device, not taken from a datasheet: a machine that is throttled,
shared or misconfigured shows it in these two numbers first.
"""

from __future__ import annotations

import statistics
import time

import torch

from portarl.backends.envinfo import environment
from portarl.bench.kernels import copy_bandwidth
from portarl.parity.record import synchronize


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype = torch.bfloat16, repeats: int = 10) -> float:
    """Throughput of an ``n x n x n`` product in ``dtype`` (2 n^3 flop a product), median of
    ``repeats`` timed products after three warm-ups, on random normal inputs (zeros run
    faster on some GPUs)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device, dtype)
    b = torch.randn(n, n, generator=gen).to(device, dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e12


def device_memory(device: torch.device) -> dict:
    """Total and free memory of the device (the host's on a CPU), in GiB."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        props = torch.cuda.get_device_properties(device)
        return {"total_gib": total / 2**30, "free_gib": free / 2**30, "multiprocessors": props.multi_processor_count,
                "compute_capability": f"{props.major}.{props.minor}"}
    if device.type == "npu":
        free, total = torch.npu.mem_get_info(device)  # torch_npu mirrors torch.cuda's API (imported by the device set-up)
        return {"total_gib": total / 2**30, "free_gib": free / 2**30}
    import os

    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return {"total_gib": pages * size / 2**30, "cores": os.cpu_count()}


def tree_digest(root=None) -> str:
    """sha256 (first 12 hex digits) of every ``.py`` file of the portarl package, by path: what
    code ran, where a copied tree's ``.git`` may be stale or absent (the lent machine's is)."""
    import hashlib
    from pathlib import Path

    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def run(plan, device: torch.device, out, work, log) -> dict:
    info = environment(device)
    info["portarl_tree_sha256"] = tree_digest()
    info["memory"] = device_memory(device)
    accelerator = device.type != "cpu"
    nbytes = (1 << 30) if accelerator else (1 << 24)
    info["copy_bandwidth_gbps"] = copy_bandwidth(device, nbytes=nbytes) / 1e9
    n = 8192 if accelerator and not plan.quick else 512
    info["matmul_bf16_tflops"] = matmul_tflops(device, n)
    info["matmul_shape"] = f"{n}x{n}x{n} bf16"
    log(f"{info['device_name']}: copy {info['copy_bandwidth_gbps']:.0f} GB/s (read + write), "
        f"bf16 matmul {info['matmul_bf16_tflops']:.1f} TFLOP/s ({info['matmul_shape']})")
    from portarl.bench.hardware.check import write_json

    write_json(out / "envinfo.json", info)
    line = (f"{info['device_name']}, torch {info['torch']}, triton {info['triton']}; copy "
            f"{info['copy_bandwidth_gbps']:.0f} GB/s, bf16 matmul {info['matmul_bf16_tflops']:.1f} TFLOP/s")
    return {"status": "ok", "line": line, "environment": info}
