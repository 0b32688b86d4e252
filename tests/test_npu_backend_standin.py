"""The npu backend's host logic over the CPU stand-in for torch_npu (tests/npu_standin.py).

NOT hardware parity: these check what the backend feeds npu_cross_entropy_loss and how
it post-processes the results (fp32 chunks, the 200,000-row limit, in-range targets for
ignored rows, ignore_index that ignores nothing). Numbers on Ascend come from the
``npu``-marked tests and ``portarl parity --device npu``.
"""

from __future__ import annotations

import pytest
import torch

from portarl import ops

pytestmark = pytest.mark.npu_standin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_feeds_fp32_rows_with_in_range_targets(standin, dtype):
    logits = torch.randn(6, 30).to(dtype)
    labels = torch.tensor([1, -100, 29, -100, 0, 7])
    logp = ops.logprobs(logits, labels, backend="npu")
    assert logp.dtype == torch.float32 and ops.computed_by(logp) == "npu"
    assert standin.calls, "the backend did not call npu_cross_entropy_loss"
    for call in standin.calls:
        assert call.dtype == torch.float32, "bf16/fp16 chunks would give bf16/fp16 log-probs"
        assert call.reduction == "none" and call.ignore_index < 0 and call.targets_in_range


def test_row_limit_is_respected(standin, monkeypatch):
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", str(1 << 30))  # only the operator's limit applies
    n = 450_001
    logits = torch.randn(n, 3)
    labels = torch.randint(0, 3, (n,))
    leaf = logits.clone().requires_grad_(True)
    logp = ops.logprobs(leaf, labels, backend="npu")
    logp.sum().backward()
    rows = [c.rows for c in standin.calls]
    assert max(rows) == 200_000 and sum(rows) == 2 * n  # forward, then backward recompute
    expected = torch.log_softmax(logits.double(), -1).gather(-1, labels[:, None]).squeeze(-1)
    assert torch.allclose(logp.double(), expected, atol=1e-5)


def test_chunk_budget_bounds_rows_per_call(standin, monkeypatch):
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", "1000")
    ops.logprobs(torch.randn(50, 100), torch.randint(0, 100, (50,)), backend="npu")
    assert [c.rows for c in standin.calls] == [10] * 5


def test_standin_rejects_what_the_operator_rejects(standin):
    with pytest.raises(RuntimeError, match="outside"):
        standin.npu_cross_entropy_loss(torch.randn(200_001, 2), torch.zeros(200_001, dtype=torch.int64), reduction="none")
    with pytest.raises(RuntimeError, match="out of range"):
        standin.npu_cross_entropy_loss(torch.randn(2, 3), torch.tensor([0, -100]), reduction="none", ignore_index=-1)
