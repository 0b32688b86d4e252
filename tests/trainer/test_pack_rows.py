"""Padding-free micro-batches on the host (portarl/trainer/phases/pack_rows.py, micro_batches.py):
the token budget counts the tokens the packed forward computes, and the row length follows
the model's per-token costs without ever computing more tokens than rows of the longest
sequence (the numerics: test_padding_free.py)."""

from __future__ import annotations

import random

from portarl.trainer.phases.micro_batches import micro_batches, pack
from portarl.trainer.phases.packing import Layout
from test_padding_free import LAYOUTS, _batch, _fake_trainer


def test_token_budget_counts_the_tokens_the_packed_forward_computes():
    prompts, completions = [2, 2, 2, 2, 2], [10, 1, 1, 1, 6]
    # Lengths 12, 3, 3, 3, 8. Padded: 12 alone (2 x 12 > 20), then 2 x 8, then 2 x 3. One
    # row (varlen): the real tokens, 12 + 8 = 20, then 3 + 3 + 3. Rows of 12 (budget 24):
    # [12], [8 + 3], then a third row (3 > the 1 left) would make 3 x 12 = 36 > 24.
    assert pack(prompts, completions, 64, 20) == [[0], [1, 4], [2, 3]]
    assert pack(prompts, completions, 64, 20, layout="varlen") == [[0, 4], [1, 2, 3]]
    assert pack(prompts, completions, 64, 24, layout="rows") == [[0, 1, 4], [2, 3]]
    batch = _batch()
    for kind in LAYOUTS:
        padded = micro_batches(_fake_trainer(None, budget=24), batch)
        packed = micro_batches(_fake_trainer(LAYOUTS[kind], budget=24), batch)
        assert len(packed) < len(padded), kind
        for rows, part in packed:
            computed = part.packed.input_ids.numel()
            assert computed <= 24 or len(rows) == 1, (kind, computed)
            if kind == "varlen":
                assert computed == int(batch.attention_mask[rows].sum())  # exactly the real tokens


def test_row_length_follows_the_models_costs():
    from portarl.trainer.phases.pack_rows import choose_rows, first_fit_rows

    lengths = [10, 9, 3, 3, 2, 1]
    assert first_fit_rows(lengths, 10) == [[0], [1, 5], [2, 3, 4]]  # 3 rows of 10 = 30 tokens
    # Attention nearly free: the fewest computed tokens, one row of 28.
    assert choose_rows(lengths, Layout("rows", linear=1000, attention=1)) == [[0, 1, 2, 3, 4, 5]]
    # Attention dear: rows as long as the longest sequence.
    assert choose_rows(lengths, Layout("rows", linear=1, attention=1000)) == [[0], [1, 5], [2, 3, 4]]
    assert choose_rows(lengths, Layout("rows", linear=1000, attention=1, longest_only=True)) == [[0], [1, 5],
                                                                                                    [2, 3, 4]]
    assert choose_rows(lengths, Layout("varlen")) == [list(range(6))]
    # Every sequence once, and never more computed tokens than rows of the longest (what
    # the token budget counted), whatever the costs.
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 30))]
        layout = Layout("rows", linear=rng.randrange(1, 10**4), attention=rng.randrange(0, 100))
        rows = choose_rows(lengths, layout)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        width = max(sum(lengths[i] for i in row) for row in rows)
        limit = len(first_fit_rows(lengths, max(lengths))) * max(lengths)
        assert len(rows) * width <= limit
        # The search stops early on a bound: the same choice as trying every capacity.
        best = min((_width_cost(lengths, first_fit_rows(lengths, max(lengths) << k), layout)
                    for k in range(12)), key=lambda x: (x[1] > limit, x[0], x[2]))
        assert _width_cost(lengths, rows, layout)[0] == best[0]


def _width_cost(lengths, rows, layout):
    from portarl.trainer.phases.pack_rows import row_cost

    width = max(sum(lengths[i] for i in row) for row in rows)
    return row_cost(len(rows), width, layout), len(rows) * width, width
