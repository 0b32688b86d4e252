"""The memory contract of ops.logprobs, measured by watching every tensor torch allocates.

Forward: no N x V temporary (nothing with N*V or more elements), only O(N) plus chunks of
at most PORTARL_CHUNK_ELEMENTS. Backward: exactly one N x V allocation, the gradient.
Also: N = 1,000,000 rows and V = 262,144 run (chunked where a backend has a row limit).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from portarl import ops
from portarl.parity.errors import assert_close
from portarl.parity.tolerances import fp32_result

CHUNK = 4096  # elements: small, so chunking is visible at test sizes


class AllocationLog(TorchDispatchMode):
    """Numel of every tensor an aten op returns (views excluded: they allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable and not _is_view(func):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.sizes.append((str(func), t.numel()))
        return out


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


@pytest.mark.parametrize("layout", ["contiguous", "sliced"])
def test_forward_has_no_n_by_v_temporary_and_backward_one(target, monkeypatch, layout):
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", str(CHUNK))
    n_rows, vocab = 96, 700  # N*V = 67,200 >> CHUNK
    storage = torch.randn(2, 49, vocab)
    logits = storage[:, :48] if layout == "sliced" else storage[:, :48].contiguous()
    labels = torch.randint(0, vocab, (2, 48))
    leaf = logits.to(target.device).detach().requires_grad_(True)
    labels = labels.to(target.device)
    forward = AllocationLog()
    with forward:
        logp, ent = ops.logprobs(leaf, labels, return_entropy=True, backend=target.backend)
    big = [(op, n) for op, n in forward.sizes if n > max(CHUNK, 4 * n_rows)]
    assert not big, f"forward allocated beyond O(N) + chunks: {big}"

    backward = AllocationLog()
    with backward:
        (logp.sum() + ent.sum()).backward()
    n_by_v = [(op, n) for op, n in backward.sizes if n >= n_rows * vocab]
    assert len(n_by_v) == 1, f"backward should allocate only the N x V gradient, got {n_by_v}"
    beyond = [(op, n) for op, n in backward.sizes if max(CHUNK, 4 * n_rows) < n < n_rows * vocab]
    assert not beyond, f"backward temporaries beyond chunks: {beyond}"


def test_allocation_log_sees_a_naive_implementation():
    """The watcher itself: an eager log_softmax + gather does allocate N x V."""
    log = AllocationLog()
    logits = torch.randn(96, 700)
    with log:
        torch.log_softmax(logits.float(), -1).gather(-1, torch.zeros(96, 1, dtype=torch.int64))
    assert max(n for _, n in log.sizes) == 96 * 700


def test_million_rows(target):
    if target.id == "cuda-interpreted":
        pytest.skip("a million programs is far too slow for the Triton interpreter; runs on hardware (cuda-gpu)")
    n_rows, vocab = 1_000_000, 8
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n_rows, vocab, generator=gen).to(target.device)
    labels = torch.randint(0, vocab, (n_rows,), generator=gen).to(target.device)
    logp = ops.logprobs(logits, labels, backend=target.backend)
    expected = torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert_close(logp, expected, fp32_result(6.0), "logp, 1M rows")
    if target.standin:
        rows_per_call = [c.rows for c in __import__("npu_standin").calls]
        assert max(rows_per_call) <= 200_000 and sum(rows_per_call) == n_rows


def test_vocab_262144(target):
    vocab = 262_144
    rows = 2 if target.id == "cuda-interpreted" else 8
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(torch.bfloat16).to(target.device)
    labels = torch.randint(0, vocab, (rows,), generator=gen).to(target.device)
    leaf = logits.detach().requires_grad_(True)
    logp, ent = ops.logprobs(leaf, labels, return_entropy=True, backend=target.backend)
    log_sm = torch.log_softmax(logits.double(), -1)
    expected = log_sm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    expected_h = -(log_sm.exp() * log_sm).sum(-1)
    assert_close(logp, expected, fp32_result(20.0), "logp, V=262144")
    assert_close(ent, expected_h, fp32_result(20.0), "entropy, V=262144")
    logp.sum().backward()
    assert leaf.grad.dtype == torch.bfloat16 and leaf.grad.shape == (rows, vocab)
