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
from portarl.parity import tolerances
from portarl.parity.float64 import logprobs_float64

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


@pytest.mark.parametrize("case, match", [
    (dict(input=torch.randn(2, 0), target=torch.zeros(2, dtype=torch.int64)), "C=0"),
    (dict(input=torch.randn(2, 3).double()), "dtype"),
    (dict(target=torch.zeros(2, dtype=torch.int32)), "int64"),
    (dict(ignore_index=3), "ignore_index"),
    (dict(label_smoothing=1.0), "label_smoothing"),
    (dict(return_zloss=True), "not supported"),
    (dict(lse_square_scale_for_zloss=0.5), "not supported"),
    (dict(weight=torch.ones(3, dtype=torch.float16)), "weight"),
    (dict(weight=torch.tensor([1.0, 0.0, 1.0])), "weight"),
    (dict(input=torch.randn(2, 3, requires_grad=True), reduction="mean", label_smoothing=0.1), "default"),
    (dict(input=torch.randn(2, 3, requires_grad=True), reduction="none", label_smoothing=0.1), "label_smoothing"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_standin_refuses_every_documented_constraint(standin, case, match):
    """The constraints of the operator's reference (torch_npu 2.13's _op_plugin_docs.py)."""
    args = dict(input=torch.randn(2, 3), target=torch.zeros(2, dtype=torch.int64), reduction="none")
    args.update(case)
    with pytest.raises(RuntimeError, match=match):
        standin.npu_cross_entropy_loss(**args)


def test_standin_gives_nan_where_a_row_holds_neg_inf(standin):
    """The hazard the backend keeps away from: the row-wide label-smoothing term is 0 * inf."""
    logits = torch.tensor([[0.0, -float("inf"), 1.0], [0.0, 0.5, 1.0]])
    low = torch.finfo(torch.float32).min
    overflow = torch.tensor([[0.0, low, low]])  # two lowest finite values: their log-prob sum is -inf
    loss, _, _, _ = standin.npu_cross_entropy_loss(logits, torch.tensor([0, 2]), reduction="none")
    assert torch.isnan(loss[0]) and torch.isfinite(loss[1])
    loss, _, _, _ = standin.npu_cross_entropy_loss(overflow, torch.tensor([0]), reduction="none")
    assert torch.isnan(loss[0])


def test_masked_vocabulary_reaches_the_operator_finite(standin):
    """-inf logits (a masked vocabulary: all but one entry of a row, a few, or the label's)
    go to the operator as a finite value whose probability is 0: log-probs, entropy and
    gradients as the float64 reference, a label on a masked entry still -inf."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=gen)
    logits[0, 1:] = -float("inf")  # one entry left: logp 0, entropy 0
    logits[1, ::3] = -float("inf")
    logits[2, 7] = -float("inf")  # the label's entry
    labels = torch.tensor([0, 1, 7, 5])
    leaf = logits.clone().requires_grad_(True)
    logp, ent = ops.logprobs(leaf, labels, return_entropy=True, backend="npu")
    g_logp = torch.tensor([1.0, 1.0, 0.0, 1.0])  # the -inf log-prob takes no gradient
    (logp[[0, 1, 3]].sum() + ent.sum()).backward()
    assert standin.calls and not any(call.has_neg_inf for call in standin.calls)
    ref = logprobs_float64(logits, labels, grad_logp=g_logp, grad_entropy=torch.ones(4))
    tol = tolerances.fp32_result(float(logits[torch.isfinite(logits)].abs().max()))
    assert logp[2].item() == -float("inf") and ref["logp"][2].item() == -float("inf")
    for got, want in ((logp[[0, 1, 3]], ref["logp"][[0, 1, 3]]), (ent, ref["entropy"]), (leaf.grad, ref["grad"])):
        assert torch.isfinite(got).all() and torch.isfinite(want).all()
        assert ((got.double() - want).abs() <= tol.allowed(want)).all()


def test_linear_logprobs_with_a_masked_bias_never_feed_neg_inf(standin):
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(5, 8, generator=gen), torch.randn(40, 8, generator=gen)
    bias = torch.zeros(40)
    bias[::2] = -float("inf")
    labels = torch.tensor([1, 3, 5, 7, 2])
    logp = ops.linear_logprobs(hidden, weight, labels, bias=bias, backend="npu")
    assert standin.calls and not any(call.has_neg_inf for call in standin.calls)
    assert torch.isfinite(logp[:4]).all() and logp[4].item() == -float("inf")
    expected = logprobs_float64(hidden.double() @ weight.double().T + bias.double(), labels)["logp"]
    tol = tolerances.fp32_result(float((hidden.abs() @ weight.abs().T).max()))
    assert ((logp[:4].double() - expected[:4]).abs() <= tol.allowed(expected[:4])).all()
