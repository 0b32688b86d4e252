"""linear_logprobs: memory contract (no N x V tensor in either direction, extra memory set
by the chunk budget) on every target, and bitwise batch invariance of the Triton path."""

from __future__ import annotations

import pytest
import torch
from test_memory_contract import AllocationLog

from portarl import ops

CHUNK = 4096  # elements


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_no_n_by_v_tensor_in_either_direction(target, monkeypatch, bias):
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", str(CHUNK))
    n_rows, vocab, width = 96, 700, 16  # N*V = 67,200 >> CHUNK; V*H = 11,200
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 48, width, generator=gen).to(target.device).requires_grad_(True)
    w = (0.3 * torch.randn(vocab, width, generator=gen)).to(target.device).requires_grad_(True)
    b = torch.randn(vocab, generator=gen).to(target.device).requires_grad_(True) if bias else None
    labels = torch.randint(0, vocab, (2, 48), generator=gen).to(target.device)
    forward = AllocationLog()
    with forward:
        logp, ent = ops.linear_logprobs(h, w, labels, bias=b, return_entropy=True, backend=target.backend)
    limit = max(CHUNK, 4 * n_rows, n_rows * width)
    big = [(op, n) for op, n in forward.sizes if n > limit]
    assert not big, f"forward allocated beyond O(N) + chunks + [N, H]: {big}"
    backward = AllocationLog()
    with backward:
        (logp.sum() + ent.sum()).backward()
    assert max(n for _, n in backward.sizes) < n_rows * vocab
    # Weight-sized buffers (the gradient, and an fp32 accumulator for it) are allowed; nothing else.
    beyond = [(op, n) for op, n in backward.sizes if n > max(limit, vocab * width)]
    assert not beyond, f"backward temporaries beyond chunks and weight-sized gradients: {beyond}"
    n_weight_sized = sum(1 for _, n in backward.sizes if n > limit)
    assert n_weight_sized <= 3, f"too many weight-sized buffers: {backward.sizes}"
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def test_extra_memory_does_not_grow_with_rows(target, monkeypatch):
    """Peak live bytes of temporaries (outside inputs/outputs/grads) is the same at N and 4N."""
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", str(CHUNK))
    vocab, width = 700, 8
    peaks = []
    for n_rows in (64, 256):
        gen = torch.Generator().manual_seed(1)
        h = torch.randn(n_rows, width, generator=gen).to(target.device).requires_grad_(True)
        w = torch.randn(vocab, width, generator=gen).to(target.device).requires_grad_(True)
        labels = torch.randint(0, vocab, (n_rows,), generator=gen).to(target.device)
        log = AllocationLog()
        with log:
            logp = ops.linear_logprobs(h, w, labels, backend=target.backend)
            logp.sum().backward()
        peaks.append(max(n for _, n in log.sizes if n not in (n_rows, n_rows * width, vocab * width)))
    assert peaks[0] <= CHUNK and peaks[1] <= CHUNK, peaks


# (300, 40): the small tile; (320, 48): H and V multiples of 16, the big (tensor-core) tile.
@pytest.mark.parametrize("shape", [(300, 40), (320, 48)], ids=["small-tile", "big-tile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_is_bitwise_identical_in_any_batch_and_chunking(triton_target, monkeypatch, dtype, shape):
    device = triton_target.device
    vocab, width = shape
    gen = torch.Generator().manual_seed(3)
    w = (0.5 * torch.randn(vocab, width, generator=gen)).to(dtype).to(device)
    probe = torch.randn(1, width, generator=gen).to(dtype)
    probe_label = torch.tensor([vocab // 3])

    def run(rows, labels, row):
        logp, ent = ops.linear_logprobs(rows.to(device), w, labels.to(device), return_entropy=True,
                                        backend=triton_target.backend)
        return logp[row].cpu(), ent[row].cpu()

    alone = run(probe, probe_label, 0)
    for chunk in (str(1 << 24), "1000"):  # one chunk, and chunks of 3 rows
        monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", chunk)
        for batch in (2, 7, 33):
            for row in sorted({0, batch // 2, batch - 1}):
                others = torch.randn(batch, width, generator=gen).to(dtype)
                labels = torch.randint(0, vocab, (batch,), generator=gen)
                others[row], labels[row] = probe[0], probe_label[0]
                inside = run(others, labels, row)
                for what, a, b in zip(("logp", "entropy"), alone, inside):
                    assert torch.equal(a, b), f"{what} of a row changed in a batch of {batch} at {row} (chunk {chunk})"
