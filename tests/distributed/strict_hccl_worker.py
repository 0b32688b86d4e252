"""One torchrun rank of ``portarl train`` in a process group that portarl made for an NPU,
over the strict stand-in backend (hccl_standin.py) and the torch_npu stand-in.

    python -m torch.distributed.run --nproc-per-node 2 strict_hccl_worker.py train --device cpu ...

``portarl.runtime.distributed.init_distributed`` runs first with an ``npu`` device, exactly as
``portarl train --device npu`` would call it, and so decides the group's backends; the
training run (CPU tensors: the stand-in has no NPU memory) then makes every collective the
trainer makes in that group. A host-side flag, count or JSON sent to a backend that refuses
CPU tensors fails here as it fails on an Ascend node.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: npu_standin

import torch  # noqa: E402

import hccl_standin  # noqa: E402
import npu_standin  # noqa: E402
from portarl.runtime import distributed as pdist  # noqa: E402
from portarl.backends.npu import torch_npu_api  # noqa: E402


def host_collectives(ctx) -> None:
    """portarl's host-side collectives with the values the trainer passes them (CPU tensors,
    Python numbers, JSON), each checked for its result."""
    from portarl.assets.reward_runner import RewardError, reward_failure
    from portarl.runtime.user_code import agree_on_failure

    rank = ctx.rank
    assert pdist.any_rank(ctx, rank == 1) and not pdist.any_rank(ctx, False)  # guard / stop flags
    assert pdist.first_code(ctx, 7 - rank) == 6  # the step guard's first stage; checkpoint agreement
    kl = pdist.all_reduce(ctx, torch.tensor([0.5 + rank]))  # the step guard's KL sync
    assert kl.device.type == "cpu" and float(kl[0]) == 2.0
    count = pdist.all_reduce(ctx, torch.tensor([float(3 + rank)]), op=torch.distributed.ReduceOp.MAX)  # micro-batches
    assert int(count.item()) == 4
    rewards = pdist.all_gather_cat(ctx, torch.tensor([1.0, 2.0]) + 10 * rank)  # the reward gather
    assert rewards.tolist() == [1.0, 2.0, 11.0, 12.0]
    assert pdist.mean_metrics(ctx, {"loss": float(rank), "step": 1})["loss"] == 0.5
    assert pdist.broadcast_json(ctx, {"batch": [1, 2]} if rank == 0 else None) == {"batch": [1, 2]}
    failure = reward_failure("probe", None, None, "grader down") if rank == 1 else None
    assert "grader down" in str(agree_on_failure(ctx, failure, RewardError))
    pdist.barrier(ctx)


def main(argv: list[str]) -> int:
    hccl_standin.install()
    with torch_npu_api.use_module(npu_standin, serves_device_type="npu"):
        ctx, device = pdist.init_distributed(torch.device("npu"))
        import torch.distributed as dist

        print(f"rank {ctx.rank}: init_distributed(npu) -> {device}, process group backend "
              f"{dist.get_backend_config()!r}", file=sys.stderr, flush=True)
        host_collectives(ctx)
        print(f"rank {ctx.rank}: host collectives ok", file=sys.stderr, flush=True)
        from portarl.cli import main as portarl_main

        return portarl_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
