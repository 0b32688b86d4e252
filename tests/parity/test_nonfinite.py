"""Non-finite inputs follow the contract on every target: NaN or +inf in a row makes that
row NaN (never a finite wrong number) and leaves other rows untouched; -inf entries are a
masked vocabulary; ignored rows stay 0 whatever they hold."""

from __future__ import annotations

import math

import pytest
import torch

from portarl import ops

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_bad_rows_are_nan_and_isolated(target, dtype):
    gen = torch.Generator().manual_seed(0)
    clean = torch.randn(6, 40, generator=gen)
    logits = clean.clone()
    logits[1, 5] = NAN
    logits[2, 9] = INF
    logits[3] = -INF  # every entry masked: no distribution
    labels = torch.tensor([1, 2, 3, 4, 5, -100])
    logits[5, 0] = NAN  # ignored row: must stay 0
    logp, ent = ops.logprobs(logits.to(dtype).to(target.device), labels.to(target.device), return_entropy=True, backend=target.backend)
    alone_logp, alone_ent = ops.logprobs(
        clean[[0, 4]].to(dtype).to(target.device), labels[[0, 4]].to(target.device), return_entropy=True, backend=target.backend
    )
    for row in (1, 2, 3):
        assert math.isnan(logp[row].item()) and math.isnan(ent[row].item()), f"row {row}"
    assert logp[5].item() == 0.0 and ent[5].item() == 0.0
    assert torch.equal(logp[[0, 4]], alone_logp) or target.backend != "cuda"
    assert torch.isfinite(logp[[0, 4]]).all() and torch.isfinite(ent[[0, 4]]).all()
    torch.testing.assert_close(logp[[0, 4]], alone_logp)


def test_neg_inf_entries_are_a_masked_vocabulary(target):
    logits = torch.tensor([[0.0, -INF, 0.0, -INF], [1.0, 2.0, -INF, 3.0]], device=target.device, requires_grad=True)
    labels = torch.tensor([2, 2], device=target.device)
    logp, ent = ops.logprobs(logits, labels, return_entropy=True, backend=target.backend)
    assert logp[0].item() == pytest.approx(math.log(0.5), abs=1e-6)
    assert ent[0].item() == pytest.approx(math.log(2.0), abs=1e-6)
    assert logp[1].item() == -INF  # the label sits on a masked entry
    expected_h = -sum(p * math.log(p) for p in torch.softmax(torch.tensor([1.0, 2.0, 3.0]), 0).tolist())
    assert ent[1].item() == pytest.approx(expected_h, abs=1e-6)
    (ent.sum() + logp[0]).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 1].item() == 0.0 and logits.grad[1, 2].item() == 0.0


def test_nan_row_gradient_does_not_leak(target):
    logits = torch.randn(3, 16)
    logits[1, 3] = NAN
    leaf = logits.to(target.device).requires_grad_(True)
    logp = ops.logprobs(leaf, torch.tensor([0, 1, 2], device=target.device), backend=target.backend)
    logp[[0, 2]].sum().backward()
    assert torch.isfinite(leaf.grad[[0, 2]]).all()
