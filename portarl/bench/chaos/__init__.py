"""The chaos run (``portarl bench chaos``): a training job restarted with ``--resume-or-start``
after every exit while a seeded schedule injects faults at random steps and moments, then its
final weights and per-step metrics compared with the uninterrupted run of the same config.

Why: each fault portarl handles is tested alone; a multi-day job meets them in combination
and in places no single test chose (a kill during a checkpoint write right after a judge
outage, a rank killed while a weight version is in flight). A fault that ends the job without
a line naming it, loses a step, repeats a step's update, leaves a process or a lock behind,
or moves the run off the uninterrupted one shows here.

Modules: :mod:`.schedule` (the faults, from a seed), :mod:`.judge` (a local judge server that
can go down), :mod:`.rewards` (a deterministic reward that can raise once), :mod:`.modes`
(colocated, async, torchrun, Ulysses, MoE: their launchers and settings), :mod:`.inject`
(finding the processes and injecting a fault), :mod:`.runner` (the supervising loop),
:mod:`.compare` (weights and metrics against the uninterrupted run).
"""

from portarl.bench.chaos.runner import run_chaos

__all__ = ["run_chaos"]
