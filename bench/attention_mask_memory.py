"""The largest tensor of a padding-free (and of a shared-prompt) scoring forward at long
context, with the attention-mask bound (portarl/trainer/phases/attention_masks.py) and with
it lifted (what portarl built before: the dense [rows, 1, W, W] mask), on the tiny Qwen2
model (hidden 64, 2 layers, sdpa, fp32, 1 thread). Work: one sequence of T tokens (16-token
prompt) and one of 5; shared-prompt: a 16-token prompt with two completions of T / 2.
Prints a Markdown table (bench/results/attention-mask-cpu.md).

    PYTHONPATH=. python bench/attention_mask_memory.py          # T = 4096 8192 16384
"""
import dataclasses, random, sys, time, types

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.masking_utils import find_packed_sequence_indices

torch.set_num_threads(1)
import portarl.trainer.phases.attention_masks as masks
from portarl.assets.models import tiny_qwen2
from portarl.trainer.phases.micro_batches import micro_batches
from portarl.trainer.phases.packing import layout_of
from portarl.trainer.phases.sequences import build_batch, completion_logprobs

VOCAB = 100


class Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes, self.shape = 0, None

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.bytes:
                self.bytes, self.shape = t.numel() * t.element_size(), tuple(t.shape)
        return out


def trainer(layout):
    train = types.SimpleNamespace(micro_batch_size=64, max_tokens_per_micro_batch=None)
    return types.SimpleNamespace(config=types.SimpleNamespace(train=train), dist=types.SimpleNamespace(enabled=False),
                                 padding_free=layout)


def work(t, share):
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]
    if share:
        prompt = tokens(16)
        return build_batch([prompt, prompt], [tokens(t // 2), tokens(t // 2)], 0, "cpu")
    return build_batch([tokens(16), [5, 6, 7]], [tokens(t - 16), [8, 9]], 0, "cpu")


def measure(model, t, share, bound):
    masks.DENSE_MASK_BOUND_BYTES = bound
    layout = dataclasses.replace(layout_of(model.config, "rows"), share_prompt=share)
    (_, part), = micro_batches(trainer(layout), work(t, share))
    spy = Largest()
    start = time.process_time()
    with torch.no_grad(), spy:
        completion_logprobs(model, part, temperature=1.0)
    mask, positions = part.packed.attention_mask, part.packed.position_ids
    if mask is not None:
        kind = f"portarl's dense {tuple(mask.shape)}"
    elif find_packed_sequence_indices(positions) is None:
        kind = f"none: causal rows {tuple(positions.shape)}"
    else:
        kind = f"transformers' dense {(positions.shape[0], 1, positions.shape[1], positions.shape[1])}"
    return kind, spy.bytes, spy.shape, time.process_time() - start


model = tiny_qwen2(VOCAB, hidden_size=64, layers=2, seed=0)
model.config._attn_implementation = "sdpa"
default = masks.DENSE_MASK_BOUND_BYTES
print("| rows | T | bound | mask | largest tensor | its shape | process CPU s |")
print("|---|---|---|---|---|---|---|")
for t in [int(a) for a in sys.argv[1:]] or [4096, 8192, 16384]:
    for share in (False, True):
        for bound, name in ((1 << 60, "lifted (before)"), (default, f"{default >> 20} MiB")):
            kind, size, shape, cpu = measure(model, t, share, bound)
            print(f"| {'shared-prompt' if share else 'padding-free'} | {t} | {name} | {kind} | "
                  f"{size / 2**20:.1f} MiB | {shape} | {cpu:.2f} |", flush=True)
