"""The token batch's layout (left-padded prompts, completions after them, labels -100 on
padding, positions from the mask) and the rollout's left padding, against a plain per-row
construction: the list-built fast path must give the same tensors exactly."""

from __future__ import annotations

import random

import torch

from portarl.rollout.hf import left_pad
from portarl.trainer.phases.sequences import build_batch


def _rows(rng, n, lo, hi):
    return [[rng.randrange(3, 60) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_build_batch_matches_a_per_row_layout():
    rng = random.Random(0)
    prompts, completions = _rows(rng, 9, 1, 7), _rows(rng, 9, 0, 5)
    completions[2] = []  # a sample that stopped at once
    batch = build_batch(prompts, completions, 0, "cpu")
    wp, wc = max(map(len, prompts)), max(1, max(map(len, completions)))
    assert batch.prompt_width == wp and batch.input_ids.shape == (9, wp + wc)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids = [0] * (wp - len(p)) + p + c + [0] * (wc - len(c))
        attn = [0] * (wp - len(p)) + [1] * (len(p) + len(c)) + [0] * (wc - len(c))
        assert batch.input_ids[i].tolist() == ids
        assert batch.attention_mask[i].tolist() == attn
        assert batch.labels[i].tolist() == c + [-100] * (wc - len(c))
        assert batch.mask[i].tolist() == [True] * len(c) + [False] * (wc - len(c))
        assert batch.position_ids[i].tolist() == [max(0, k) for k in torch.tensor(attn).cumsum(0).sub(1).tolist()]
    assert batch.input_ids.dtype == batch.labels.dtype == torch.long


def test_left_pad_matches_a_per_row_layout():
    rng = random.Random(1)
    seqs = _rows(rng, 5, 1, 8)
    ids, mask = left_pad(seqs, 7, "cpu")
    width = max(map(len, seqs))
    for i, s in enumerate(seqs):
        assert ids[i].tolist() == [7] * (width - len(s)) + s
        assert mask[i].tolist() == [0] * (width - len(s)) + [1] * len(s)
