"""aggregate_loss: every mode by hand, micro-batch invariance, masked sequences."""

from __future__ import annotations

import pytest
import torch

from portarl.core import AGG_MODES, GRPOConfig, aggregate_loss, compute_loss, sequence_count, token_count

V = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)  # third: empty


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-mean", (2.0 + 4.0) / 2),
        ("seq-mean-token-sum", (6.0 + 4.0) / 2),
        ("seq-mean-token-sum-norm", 10.0 / (2 * 8)),
    ],
)
def test_modes_by_hand(mode, expected):
    out = aggregate_loss(V, M, mode, max_response_length=8)
    assert out.item() == pytest.approx(expected) and out.dtype == torch.float32


def test_nothing_valid_is_zero_with_a_graph():
    v = torch.full((2, 3), float("nan"), requires_grad=True)
    for mode in AGG_MODES:
        out = aggregate_loss(v, torch.zeros(2, 3, dtype=torch.bool), mode, max_response_length=3)
        assert out.item() == 0.0
        out.backward()
        assert torch.equal(v.grad, torch.zeros(2, 3))
        v.grad = None


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_sum_to_the_full_batch(mode):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(8, 6, generator=gen) < 0.7
    mask[3] = False
    full_leaf = values.clone().requires_grad_(True)
    full = aggregate_loss(full_leaf, mask, mode, max_response_length=6)
    full.backward()

    norms = dict(num_global_tokens=token_count(mask), num_global_seqs=sequence_count(mask), max_response_length=6)
    micro_leaf = values.clone().requires_grad_(True)
    total = sum(
        aggregate_loss(micro_leaf[i : i + 3], mask[i : i + 3], mode, **norms) for i in range(0, 8, 3)
    )
    total.backward()
    torch.testing.assert_close(total.double(), full.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(micro_leaf.grad, full_leaf.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_compute_loss_micro_batch_invariance(mode):
    """The whole loss (PG + KL + entropy) sharded in micro-batches equals one batch."""
    gen = torch.Generator().manual_seed(1)
    b, t = 6, 5
    old = -torch.rand(b, t, generator=gen) * 3
    logp = old + 0.2 * torch.randn(b, t, generator=gen)
    ref = old + 0.3 * torch.randn(b, t, generator=gen)
    ent = torch.rand(b, t, generator=gen)
    adv = torch.randn(b, generator=gen)
    mask = torch.rand(b, t, generator=gen) < 0.8
    cfg = GRPOConfig(loss_agg_mode=mode, max_response_length=t, kl_coef=0.1, entropy_coef=0.01)

    full_leaf = logp.clone().requires_grad_(True)
    full, _ = compute_loss(full_leaf, old, adv, mask, config=cfg, ref_logp=ref, entropy=ent)
    full.backward()
    norms = dict(num_global_tokens=token_count(mask), num_global_seqs=sequence_count(mask))
    leaf = logp.clone().requires_grad_(True)
    total = 0.0
    for i in (0, 2, 5):
        j = {0: 2, 2: 5, 5: 6}[i]
        part, _ = compute_loss(
            leaf[i:j], old[i:j], adv[i:j], mask[i:j], config=cfg, ref_logp=ref[i:j], entropy=ent[i:j], **norms
        )
        total = total + part
    total.backward()
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad, full_leaf.grad, rtol=1e-5, atol=1e-7)


def test_errors():
    with pytest.raises(ValueError, match="not one of"):
        aggregate_loss(V, M, "mean")
    with pytest.raises(ValueError, match="needs max_response_length"):
        aggregate_loss(V, M, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="smaller than this shard's own count"):
        aggregate_loss(V, M, "token-mean", num_global_tokens=2)
    with pytest.raises(ValueError, match="mask shape"):
        aggregate_loss(V, M[:2], "token-mean")
