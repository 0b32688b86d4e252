"""Batch invariance of the Triton kernels: a row's log-prob, entropy and gradient are
bitwise identical whether it is computed alone or inside batches of several sizes, at any
position. (One program per row, tiles chosen from V alone, fixed tile order.)"""

from __future__ import annotations

import pytest
import torch

from portarl import ops

BATCH_SIZES = [1, 2, 7, 33]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [17, 5000])  # one tile, and several tiles with a ragged tail
def test_row_is_bitwise_identical_in_any_batch(triton_target, dtype, vocab):
    device = triton_target.device
    gen = torch.Generator().manual_seed(vocab)
    probe = (4 * torch.randn(1, vocab, generator=gen)).to(dtype)
    probe_label = torch.tensor([vocab // 3])
    g_logp, g_ent = torch.tensor([0.7]), torch.tensor([-0.3])

    def run(logits, labels, row):
        leaf = logits.to(device).detach().requires_grad_(True)
        logp, ent = ops.logprobs(leaf, labels.to(device), return_entropy=True, backend=triton_target.backend)
        gl = torch.zeros(labels.shape)
        ge = torch.zeros(labels.shape)
        gl[row], ge[row] = g_logp, g_ent
        torch.autograd.backward((logp, ent), (gl.to(device), ge.to(device)))
        return logp[row].cpu(), ent[row].cpu(), leaf.grad[row].cpu()

    alone = run(probe, probe_label, 0)
    for batch in BATCH_SIZES:
        for row in sorted({0, batch // 2, batch - 1}):
            others = (4 * torch.randn(batch, vocab, generator=gen)).to(dtype)
            labels = torch.randint(0, vocab, (batch,), generator=gen)
            others[row], labels[row] = probe[0], probe_label[0]
            inside = run(others, labels, row)
            for what, a, b in zip(("logp", "entropy", "grad"), alone, inside):
                assert torch.equal(a, b), f"{what} of a row differs alone vs at position {row} of a batch of {batch}"
