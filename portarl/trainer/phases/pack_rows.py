"""Which sequences of a padding-free micro-batch share a row (:mod:`portarl.trainer.phases.packing`).

With the varlen layout (flash attention) there is one row: the kernel attends within each
sequence's span, so a row costs its tokens. Under a dense block-diagonal mask (SDPA,
eager and flex attention without compilation on CPU) every query of a row meets every key
of the row, masked or not, so a row of width W costs W x (linear + W x attention)
multiply-adds per decoder layer (``linear``: the q/k/v/o projections and the MLP per
token; ``attention``: the QK^T and PV products per key). Longer rows waste less of their
tails; shorter rows attend less. :func:`choose_rows` packs first-fit decreasing at
capacities the longest sequence, 2x, 4x, ... up to one row, and keeps the cheapest layout
that computes no more tokens than rows of the longest sequence would (what the token
budget counts: :class:`portarl.trainer.phases.micro_batches._Tokens`), so a micro-batch never
outgrows its budget, and whose attention mask stays within the bound
(:data:`portarl.trainer.phases.attention_masks.DENSE_MASK_BOUND_BYTES`; rows of the longest
sequence over it become mask-free causal rows: :func:`portarl.trainer.phases.attention_masks.causal_rows`).
"""

from __future__ import annotations

from portarl.trainer.phases.attention_masks import fits


def first_fit_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` in rows of at most ``capacity`` tokens (first-fit decreasing;
    a length over the capacity gets a row of its own). Rows in order of creation, each
    row's indices in placement order."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = first_fit(room, lengths[i])
        if r is None:
            rows.append([i])
            room.append(capacity - lengths[i])
        else:
            rows[r].append(i)
            room[r] -= lengths[i]
    return rows


def first_fit(room: list[int], n: int) -> int | None:
    """The first index of ``room`` with at least ``n`` free, or None."""
    if not room or max(room) < n:  # the common case (rows nearly full), at C speed
        return None
    return next(r for r, free in enumerate(room) if n <= free)


def row_cost(rows: int, width: int, layout) -> int:
    """Multiply-adds per decoder layer of ``rows`` rows of ``width`` tokens under a dense mask."""
    return rows * width * (layout.linear + layout.attention * width)


def choose_rows(lengths: list[int], layout) -> list[list[int]]:
    """The rows (lists of indices into ``lengths``) of one micro-batch for ``layout``
    (:class:`portarl.trainer.phases.packing.Layout`): one row for ``"varlen"``; for ``"rows"``
    the cheapest first-fit packing (module docstring)."""
    if layout.kind == "varlen":
        return [list(range(len(lengths)))]
    longest = max(lengths, default=1)
    best = first_fit_rows(lengths, longest)
    if layout.longest_only or len(best) < 2:
        return best
    limit = len(best) * longest
    best_cost = row_cost(len(best), longest, layout)
    real = sum(lengths)
    capacity = 2 * longest
    # With two rows or more at a capacity C >= 2 x longest, the first row is fuller than
    # C - longest >= C / 2 (first fit left something out), so rows x width >= the real
    # tokens and width > C / 2: no capacity from C on can cost less than
    # real x (linear + attention x C / 2), and one row costs real x (linear + attention x real).
    while real * (layout.linear + layout.attention * min(capacity // 2, real)) < best_cost:
        rows = first_fit_rows(lengths, capacity)
        width = max(sum(lengths[i] for i in row) for row in rows)
        cost = row_cost(len(rows), width, layout)
        if len(rows) * width <= limit and cost < best_cost and fits(len(rows), width, layout):
            best, best_cost = rows, cost
        if len(rows) == 1:
            break
        capacity *= 2
    return best


__all__ = ["choose_rows", "first_fit", "first_fit_rows", "row_cost"]
