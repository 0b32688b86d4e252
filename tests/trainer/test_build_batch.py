"""build_batch (vectorised: the batch tensors built at once) lays rows out exactly as the
per-row reference: prompts left-padded, completions after them, -100 labels on padding."""

from __future__ import annotations

import random

import torch

from portarl.trainer.sequences import build_batch


def _per_row(prompts, completions, pad_id):
    width_p, width_c = max(len(p) for p in prompts), max(1, max(len(c) for c in completions))
    n = len(prompts)
    ids = torch.full((n, width_p + width_c), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width_p + width_c), dtype=torch.long)
    labels = torch.full((n, width_c), -100, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, width_p - len(p): width_p] = torch.tensor(p, dtype=torch.long)
        attn[i, width_p - len(p): width_p] = 1
        if c:
            ids[i, width_p: width_p + len(c)] = torch.tensor(c, dtype=torch.long)
            attn[i, width_p: width_p + len(c)] = 1
            labels[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0), labels


def test_matches_the_per_row_layout():
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 6)
        prompts = [[rng.randint(0, 50) for _ in range(rng.randint(1, 7))] for _ in range(n)]
        completions = [[rng.randint(0, 50) for _ in range(rng.randint(0, 5))] for _ in range(n)]
        if trial % 50 == 0:
            completions = [[] for _ in range(n)]  # nothing generated at all
        got = build_batch(prompts, completions, 3, "cpu")
        ids, attn, positions, labels = _per_row(prompts, completions, 3)
        assert torch.equal(got.input_ids, ids) and torch.equal(got.attention_mask, attn)
        assert torch.equal(got.position_ids, positions) and torch.equal(got.labels, labels)
        assert torch.equal(got.mask, labels != -100) and got.prompt_width == max(map(len, prompts))
