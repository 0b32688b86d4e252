"""``portarl hardware-check``: hardware acceptance in one prepared command.

A GPU machine is lent rarely and briefly (minutes of device time, no network, a bare image
with torch, triton and transformers but no portarl), and an Ascend host is a colleague's.
This package turns that time into measured rows instead of guesses: one command, run from
the project's tree with ``PYTHONPATH`` alone, that checks a device in stages and leaves one
folder of at most 8 files that a person reads (``summary.md`` first) and that the other
``portarl`` commands read back (``portarl parity compare``, ``portarl bench stability
compare`` / ``--replay-from``).

Stages (:mod:`portarl.bench.hardware.plan` sizes them per device; each runs in a child
process of its own with a time limit, so a kernel that hangs or a CUDA error that poisons
the context costs one stage, not the check):

1. ``environment``: device, memory, versions, measured copy bandwidth and bf16 matmul
   throughput (:mod:`.environment`);
2. ``parity``: every op of every backend usable there, in every dtype, against float64
   (:mod:`.parity_stage`);
3. ``kernels``: the fused ops at RL shapes against eager, ``torch.compile`` and Liger
   (:mod:`.kernels_stage`);
4. ``training``: a short GRPO run in bf16 and fp16 with the features a real run uses, and
   its stability record (:mod:`.training_stage`);
5. ``hardware-tests``: the ``gpu`` / ``npu``-marked tests, the hardware-sized ones one at a
   time beside the rest (:mod:`.tests_stage`).

The orchestration, exit status and the output folder's contract are in :mod:`.check`.
"""
