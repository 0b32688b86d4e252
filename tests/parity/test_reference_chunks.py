"""The reference backend's CPU chunk budget (issue 17): cache-sized work buffers by
default, the accelerators' budget elsewhere, ``PORTARL_CHUNK_ELEMENTS`` overriding both."""

from __future__ import annotations

import pytest
import torch

from portarl import ops
from portarl.backends import rows
from test_memory_contract import AllocationLog


def test_budgets(monkeypatch):
    monkeypatch.delenv("PORTARL_CHUNK_ELEMENTS", raising=False)
    assert rows.chunk_elements() == 1 << 24
    assert rows.cpu_chunk_elements() == rows.CPU_CHUNK_BYTES // 4 == 1 << 20
    assert rows.chunk_rows(32000, elements=rows.cpu_chunk_elements()) == 32
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", "5000")
    assert rows.chunk_elements() == rows.cpu_chunk_elements() == 5000
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", "-1")
    with pytest.raises(ValueError):
        rows.cpu_chunk_elements()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_uses_the_cpu_budget_and_chunking_changes_nothing(monkeypatch, dtype):
    monkeypatch.delenv("PORTARL_CHUNK_ELEMENTS", raising=False)
    n_rows, vocab = 100, 32000  # 3.2 M elements: four chunks of 32 rows at the CPU budget
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(n_rows, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, (n_rows,), generator=gen)
    g = torch.randn(n_rows, generator=gen)

    def run():
        leaf = logits.detach().requires_grad_(True)
        logp, ent = ops.logprobs(leaf, labels, return_entropy=True, backend="reference")
        (logp * g + ent).sum().backward()
        return logp, ent, leaf.grad

    log = AllocationLog()
    with log:
        chunked = run()
    budget = rows.cpu_chunk_elements()
    big = [(op, n) for op, n in log.sizes if budget < n < n_rows * vocab]
    assert not big, f"temporaries beyond the CPU budget: {big}"
    # Work buffers allocated once per call and reused by every chunk: forward z and exp(z);
    # backward z, plus a staging buffer unless the gradient (fp32) is built in place.
    buffers = sum(1 for _, n in log.sizes if n == budget - budget % vocab)
    assert buffers == 2 + (1 if dtype == torch.float32 else 2)
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", str(n_rows * vocab))  # one chunk
    whole = run()
    for what, a, b in zip(("logp", "entropy", "grad"), chunked, whole):
        assert torch.equal(a, b), f"{what} depends on the chunking"
