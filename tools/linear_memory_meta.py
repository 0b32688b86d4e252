"""Peak extra memory of linear_logprobs vs eager and TRL-style chunked scoring, counted
exactly on the ``meta`` device (no compute: the same LiveBytes accounting as
``portarl bench kernels`` on CPU, i.e. the peak of live tensor bytes torch allocates
during the call, inputs excluded). Used when the machine is too loaded for the timed run.

    python tools/linear_memory_meta.py
"""

import torch

from portarl.backends.reference.linear_logprobs import ReferenceLinearLogprobs
from portarl.bench.kernels import LiveBytes
from portarl.bench.linear import chunked, eager


def fused(h, w, y):
    return ReferenceLinearLogprobs.apply(h, w, None, y, 1.0, -100, False)[0]


def peak(fn, n, hdim, v, backward):
    h = torch.empty(n, hdim, dtype=torch.bfloat16, device="meta").requires_grad_(backward)
    w = torch.empty(v, hdim, dtype=torch.bfloat16, device="meta").requires_grad_(backward)
    y = torch.zeros(n, dtype=torch.int64, device="meta")
    mode = LiveBytes()
    with mode:
        out = fn(h, w, y)
        if backward:
            out.sum().backward()
    return mode.peak / 2**20


print("| N | H | V | dtype | mode | method | peak extra MiB | vs eager |")
print("|---|---|---|---|---|---|---|---|")
for n in (1024, 4096):
    for backward in (False, True):
        rows = {name: peak(fn, n, 896, 151936, backward)
                for name, fn in (("portarl:reference", fused), ("eager", eager), ("chunked", chunked))}
        for name, mib in rows.items():
            print(f"| {n} | 896 | 151936 | bf16 | {'fwd+bwd' if backward else 'fwd'} | {name} | {mib:.0f} | "
                  f"{mib / rows['eager']:.3f}x |")
