"""One rank of the exit-race reproduction (tools/stress_distributed_exit.sh --mechanism).

Gloo collectives on DTensors (as FSDP2 runs them), ``destroy_process_group()``, then either
the plain interpreter exit (``plain``: what portarl's CLI did before portarl/runtime/exit_path.py)
or portarl's exit path (``portarl``). A plain exit can die with ``terminate called without
an active exception``: the Gloo backend outlives destroy_process_group (DTensor's caches
hold its mesh) and its worker threads race interpreter finalisation.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
if mode not in ("plain", "portarl"):
    sys.exit(f"exit_race_worker.py: mode must be plain or portarl, got {mode!r}")
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
x = distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
for _ in range(20):
    y = (x @ x.T).full_tensor()
    t = torch.ones(1000)
    dist.all_reduce(t)
dist.destroy_process_group()
if mode == "portarl":
    from portarl.runtime.exit_path import leave_process

    leave_process(0)
