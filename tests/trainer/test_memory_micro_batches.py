"""Token-budget micro-batches (``train.max_tokens_per_micro_batch``): packing rules, and the
same gradient (and no-grad log-probs) as one micro-batch within fp32 rounding."""

from __future__ import annotations

import types

import pytest
import torch

import portarl.trainer.phases.micro_batches as mb
import run_guard
from portarl.trainer.phases.micro_batches import micro_batches, pack, split_to
from portarl.trainer.phases.scoring import no_grad_logprobs
from portarl.trainer.phases.sequences import build_batch
from test_memory_checkpointing import _assert_same, _gradients


def test_pack_respects_budget_rows_and_covers_every_row_once():
    prompts = [3, 7, 2, 5, 5, 1, 9, 4]
    completions = [4, 1, 6, 0, 3, 2, 8, 5]
    parts = pack(prompts, completions, max_rows=3, max_tokens=24)
    assert sorted(i for p in parts for i in p) == list(range(8))
    for part in parts:
        width = max(prompts[i] for i in part) + max(max(1, completions[i]) for i in part)
        assert len(part) <= 3 and (len(part) * width <= 24 or len(part) == 1)
    assert parts[0] == [6]  # the longest (17 tokens) first, alone: a second row would need 2 x 17 > 24
    assert pack(prompts, completions, max_rows=64, max_tokens=10**6) == [list(range(8))]


def test_row_over_budget_runs_alone():
    assert pack([10, 2, 2], [10, 2, 2], max_rows=8, max_tokens=8) == [[0], [1, 2]]


def test_split_to_equalises_counts_across_ranks():
    parts = split_to([[0, 1, 2, 3], [4]], 4)
    assert len(parts) == 4 and sorted(i for p in parts for i in p) == list(range(5))
    with pytest.raises(ValueError):
        split_to([[0], [1]], 3)


def _fake_trainer(budget, rows=64):
    train = types.SimpleNamespace(micro_batch_size=rows, max_tokens_per_micro_batch=budget)
    return types.SimpleNamespace(config=types.SimpleNamespace(train=train), dist=types.SimpleNamespace(enabled=False))


def test_micro_batches_are_cut_to_their_own_widths(monkeypatch):
    batch = build_batch([[5, 6], [5, 6, 7, 8, 9], [4]], [[1, 2, 3, 4], [1], [2, 2]], 0, "cpu")
    warnings: list = []
    monkeypatch.setattr(mb.log, "warning", lambda msg, *args: warnings.append(msg % args))
    trainer = _fake_trainer(5)
    parts = micro_batches(trainer, batch)
    micro_batches(trainer, batch)
    widths = {tuple(rows.tolist()): (part.prompt_width, part.labels.shape[1]) for rows, part in parts}
    assert widths == {(0,): (2, 4), (1,): (5, 1), (2,): (1, 2)}
    assert len(warnings) == 1 and "train.max_tokens_per_micro_batch=5 is below the longest sequence" in warnings[0]
    for rows, part in parts:  # the kept columns are exactly the rows' tokens
        assert torch.equal(part.attention_mask.sum(-1), batch.attention_mask[rows].sum(-1))
        assert torch.equal(part.position_ids[part.attention_mask.bool()],
                           batch.position_ids[rows][batch.attention_mask[rows].bool()])


def test_fixed_slices_without_a_budget():
    batch = build_batch([[1]] * 5, [[2]] * 5, 0, "cpu")
    assert [r for r, _ in micro_batches(_fake_trainer(None, rows=2), batch)] == [slice(0, 2), slice(2, 4), slice(4, 6)]


@pytest.mark.compares_runs
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("budget", [12, 30])
def test_any_budget_gives_the_one_micro_batch_gradient(tmp_path, monkeypatch, budget, lora):
    extra = ["model.lora.r=4"] if lora else []
    one, _ = _gradients(tmp_path, monkeypatch, "train.max_tokens_per_micro_batch=null", "train.micro_batch_size=64",
                        *extra, name="one")
    packed, trainer = _gradients(tmp_path, monkeypatch, f"train.max_tokens_per_micro_batch={budget}", *extra,
                                 name=f"b{budget}")
    run_guard.assert_gradient_flows(one, what="one micro-batch's gradients")
    run_guard.assert_gradient_flows(packed, what=f"the gradients over budget-{budget} micro-batches")
    _assert_same(one, packed)


def test_no_grad_logprobs_equal_one_micro_batch(tmp_path, monkeypatch):
    _, trainer = _gradients(tmp_path, monkeypatch, name="t")
    batch = build_batch([[5, 6], [5, 6, 7, 8, 9], [4], [7, 7, 7]], [[1, 2, 3, 4], [1], [2, 2], [3, 3, 3, 3, 3]], 0,
                        "cpu")
    trainer.config.train.max_tokens_per_micro_batch = None
    whole = no_grad_logprobs(trainer, trainer.model, batch)
    trainer.config.train.max_tokens_per_micro_batch = 9
    assert len(micro_batches(trainer, batch)) > 2
    packed = no_grad_logprobs(trainer, trainer.model, batch)
    torch.testing.assert_close(packed, whole, rtol=1e-5, atol=1e-6)
    assert bool((packed[~batch.mask] == 0).all())
