"""torch.distributed for portarl: process group from torchrun, FSDP2 sharding, collectives.

``init_distributed`` reads torchrun's environment (``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``), decides the process group's backends (:func:`process_group_backend`), pins
the rank to its device and returns a :class:`DistContext`. Without torchrun it returns a
single-process context and nothing else changes.

Backends: the group carries Gloo for CPU tensors beside the accelerator's backend
(``cpu:gloo,cuda:nccl``, ``cpu:gloo,npu:hccl``; plain ``gloo`` on the CPU), as verl does.
torch dispatches each collective by its tensor's device, so host-side flags, counts and
JSON (step-guard and stop flags, the KL sync, the micro-batch count, the reward gather,
checkpoint agreement, the async pipeline's batch) go over Gloo, and device tensors (FSDP2's
shards, the token counts) stay on the device with NCCL / HCCL. Nothing is copied between
host and device to fit a backend: a flag on the host never costs a device sync, and HCCL,
which torch_npu registers for the ``npu`` device type only, never sees a CPU tensor (it
would raise ``No backend type associated with device type cpu``).

Design choices the trainer relies on:
- groups are never split across ranks (each rank rolls out whole groups), and rewards are
  all-gathered so advantages are computed on the global batch, identically on every rank;
- the global valid-token and sequence counts are all-reduced, and each rank's loss is its
  share of the global loss; FSDP2 averages gradients over ranks, so the loss is scaled by
  the world size to make the reduced gradient the global batch's gradient;
- skip decisions are collective: a rank that sees a non-finite value keeps taking part in
  every collective and the decision is all-reduced at two sync points.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("portarl.runtime.distributed")

BACKEND_FOR_DEVICE = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    #: The device's backend (``nccl``, ``hccl`` or ``gloo``); see :func:`process_group_backend`.
    backend: str | None = None
    #: Group for CPU-tensor collectives: ``None`` is the default group (which has Gloo for the
    #: CPU when portarl made it); a Gloo group of its own when the caller made a default group
    #: without a CPU backend before portarl was called.
    host_group: object = dataclasses.field(default=None, compare=False, repr=False)
    #: One rank under torchrun that shards anyway (``distributed.fsdp_one_rank``).
    one_rank_sharded: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or self.one_rank_sharded

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = DistContext()


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


#: Default collective timeout and heartbeat limit (``distributed.timeout_s``), seconds.
DEFAULT_TIMEOUT_S = 600.0
_heartbeat = None
_joined = False  # this process joined a torchrun job (it must leave through leave_process)


def process_group_backend(device_type: str) -> str:
    """The ``init_process_group`` backend string for a job whose model is on ``device_type``:
    Gloo for CPU tensors beside the accelerator's own backend."""
    backend = BACKEND_FOR_DEVICE.get(device_type)
    if backend is None:
        raise ValueError(f"no distributed backend for device type {device_type!r}")
    return backend if device_type == "cpu" else f"cpu:gloo,{device_type}:{backend}"


def _serves_cpu(group=None) -> bool:
    """Whether ``group`` (default: the default group) has a backend for CPU tensors."""
    try:
        return "cpu" in dist.get_backend_config(group)
    except (RuntimeError, ValueError):  # pragma: no cover - a group torch cannot describe
        return False


def init_distributed(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S, *, fsdp_one_rank: bool = False
                     ) -> tuple[DistContext, torch.device]:
    """Initialise the process group (when launched with torchrun) and pin this rank's device.

    The one place that decides the group's backends (:func:`process_group_backend`). A
    default group made by the caller before this is kept; if it has no CPU backend, a Gloo
    group is added for the host-side collectives (:attr:`DistContext.host_group`).

    ``timeout_s`` bounds every collective, and a heartbeat thread (:mod:`portarl.runtime.heartbeat`)
    stops the job, naming the rank, when one rank's process stops running for half of it.

    ``fsdp_one_rank``: a torchrun job of one rank joins a group of one and shards
    (``distributed.fsdp_one_rank``); without it, one rank is one plain process."""
    global _heartbeat, _joined
    one_rank = fsdp_one_rank and os.environ.get("WORLD_SIZE") == "1" and "RANK" in os.environ
    if not launched_by_torchrun() and not one_rank:
        return SINGLE, device
    _joined = True
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    spec = process_group_backend(device.type)
    if device.type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    elif device.type == "npu":
        from portarl.backends.npu import torch_npu_api

        torch_npu_api.set_device(local)
        device = torch.device("npu", local)
    host_group = None
    if not dist.is_initialized():
        watch = None
        if nodes() > 1 and os.environ.get("MASTER_ADDR"):  # one node: torchrun ends the others itself
            from portarl.runtime.heartbeat import StartupWatch

            watch = StartupWatch(rank).start()  # a rank of another node that fails to start ends this one
        try:
            dist.init_process_group(spec, timeout=timedelta(seconds=timeout_s))
        finally:
            if watch is not None:
                watch.stop()
        if rank == 0:
            log.info("process group: %s, %d ranks", spec, world)
    elif not _serves_cpu():
        host_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))  # every rank, in order
        if rank == 0:
            log.info("process group made by the caller (%s): a Gloo group added for host-side collectives",
                     dist.get_backend_config())
    if _heartbeat is None:
        from portarl.runtime.heartbeat import start_heartbeat

        _heartbeat = start_heartbeat(rank, world, timeout_s)
    return DistContext(rank, world, local, BACKEND_FOR_DEVICE[device.type], host_group, one_rank), device


def full(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: an FSDP2 shard (a DTensor) gathered with ``full_tensor()``, an
    all-gather that every rank must run at the same point; any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def shutdown(agreed: bool = True) -> None:
    """Leave the job (steps 1-3 of :mod:`portarl.runtime.exit_path`); idempotent.

    ``agreed``: every rank is on its way out together (a finished run, an agreed stop), so
    they meet at an exit barrier first; ``False`` for a rank leaving alone (an error on this
    rank, a second signal), which must not wait for peers that are not coming."""
    global _heartbeat
    beat, _heartbeat = _heartbeat, None
    leave_job(beat, agreed)


def leave_job(heartbeat, agreed: bool) -> None:
    """Steps 1-3 of :mod:`portarl.runtime.exit_path`; safe to call when no process group exists
    (then only step 1). Here, below ``exit_path``, because :func:`shutdown` runs it."""
    if heartbeat is not None:
        heartbeat.stop()
        if agreed and dist.is_initialized() and not heartbeat.exit_barrier():
            log.warning("rank %d: not every rank reached the exit within distributed.timeout_s=%g s; leaving anyway",
                        heartbeat.rank, heartbeat.timeout_s)
    if dist.is_initialized():
        dist.destroy_process_group()


def joined_a_job() -> bool:
    """Whether this process joined a torchrun job (and so must end through
    :func:`portarl.runtime.exit_path.leave_process`)."""
    return _joined


#: What a collective raises on a rank whose peer's process is gone: Gloo's TCP pairs, NCCL's
#: and HCCL's communicators (the peer's own line says why it went).
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
              "communicator was aborted", "remote process exited")


def peer_gone(err: BaseException) -> str | None:
    """What ``err``, raised on a rank of a torchrun job, says when it is a collective that failed
    because another rank's process ended (not a failure of this rank's own): e.g. "Connection
    reset by peer"; else None."""
    if not (_joined and isinstance(err, RuntimeError)):
        return None
    return next((s for s in _PEER_GONE if s in str(err)), None)


def nodes() -> int:
    """How many torchrun agents (nodes) the job spans: torchrun's ``GROUP_WORLD_SIZE``."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1"))


def lost_peers() -> str | None:
    """Which peers stopped, from the heartbeat (:meth:`portarl.runtime.heartbeat.Heartbeat.silent_peers`:
    waits two and a half beats); ``None`` when not known or every peer still beats."""
    return None if _heartbeat is None else _heartbeat.silent_peers()


def has_sharded_params(params) -> bool:
    """Whether any of ``params`` is an FSDP2 shard (a DTensor, which carries its mesh)."""
    return any(hasattr(p, "device_mesh") for p in params)


def shard(model: torch.nn.Module, *, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer, then the root. ``param_dtype`` (mixed
    precision) computes in that dtype over fp32 parameters, gradients reduced in fp32.

    A vision-language model: its decoder layers are the language model's; the vision tower
    stays in the root unit, gathered once per forward with the embeddings and the head.
    Its blocks as units of their own would all-gather only on a rank whose micro-batch or
    prompts have images, so a rank with text-only rows would leave its peer waiting in a
    collective (the rollout prefills each rank's own prompts). A micro-batch without images
    still gives the tower's trainable parameters a zero gradient
    (:class:`portarl.trainer.phases.sequences._VisionGradsEverywhere`), so the root's
    reduce-scatter is the same size on every rank. Frozen parameters (the tower, by
    default) are sharded beside trainable ones; FSDP2 reduces only what has gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers to shard")
    # The mesh of the device the model is on: FSDP2's default is torch's accelerator, which
    # would move a model that trains on the CPU (``--device cpu``) onto an idle GPU / NPU.
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _group_for(ctx: DistContext, tensor: torch.Tensor):
    """The group that reduces ``tensor`` where it lives: the host group for CPU tensors,
    the default group (the device's backend) for device tensors. Never a copy."""
    return ctx.host_group if tensor.device.type == "cpu" else None


def all_reduce(ctx: DistContext, value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``value`` reduced over ranks, on ``value``'s device (host values on the host)."""
    if not ctx.enabled:
        return value
    t = value.detach().clone()
    dist.all_reduce(t, op=op, group=_group_for(ctx, t))
    return t


def all_gather_cat(ctx: DistContext, value: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors from every rank, in rank order, on ``value``'s device."""
    if not ctx.enabled:
        return value
    local = value.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(parts, local, group=_group_for(ctx, local))
    return torch.cat(parts)


def any_rank(ctx: DistContext, flag: bool) -> bool:
    return bool(all_reduce(ctx, torch.tensor([1.0 if flag else 0.0]), op=dist.ReduceOp.MAX).item())


def first_code(ctx: DistContext, code: int) -> int:
    """The smallest code over ranks (codes order pipeline stages; large = nothing)."""
    return int(all_reduce(ctx, torch.tensor([float(code)]), op=dist.ReduceOp.MIN).item())


def mean_metrics(ctx: DistContext, metrics: dict) -> dict:
    """Average numeric metrics over ranks (keys from every rank; non-numbers from rank 0)."""
    if not ctx.enabled:
        return metrics
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, {k: v for k, v in metrics.items() if not k.startswith("_")}, group=ctx.host_group)
    out = dict(metrics)
    keys = set().union(*(g.keys() for g in gathered))
    for key in keys:
        values = [g[key] for g in gathered if key in g]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and key != "step":
            out[key] = sum(values) / len(values)
            if key in ("skipped", "guard/skipped_total", "guard/consecutive_skips"):
                out[key] = max(values)
        elif key not in out:
            out[key] = values[0]
    return out


def broadcast_json(ctx: DistContext, value, group=None):
    """Rank 0's JSON-able ``value`` on every rank (the others pass ``None``): its UTF-8
    JSON as a byte tensor, length first. JSON, not ``broadcast_object_list``'s pickle:
    nothing unpickled, and floats round-trip exactly. ``group``: a CPU (gloo) group, e.g.
    one with a longer timeout than the job's collectives (default: the host group)."""
    if not ctx.enabled:
        return value
    group = group if group is not None else ctx.host_group
    data = json.dumps(value).encode() if ctx.is_main else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if ctx.is_main else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return value if ctx.is_main else json.loads(bytes(buf.numpy()).decode())


#: The variables torchrun sets for its workers; a process a rank starts (the async rollout
#: worker) must not see them, or it would take itself for a rank of the job.
TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def without_torchrun_env(env: dict) -> dict:
    """``env`` without torchrun's worker variables (``TORCHRUN_ENV``, ``TORCHELASTIC_*``)."""
    return {k: v for k, v in env.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier(group=ctx.host_group)


def local_launcher(nproc: int) -> list[str]:
    """The command line that starts ``nproc`` ranks on this machine with torchrun, on a free
    rendezvous port: torchrun's default, 29500, makes two jobs started side by side on one
    machine (two benchmarks, two test workers) join each other's rendezvous or fail to bind."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port)]
