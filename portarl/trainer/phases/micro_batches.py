"""Micro-batches of an optimizer step (and of the no-grad scoring forwards) cut by a token
budget: ``train.max_tokens_per_micro_batch``, verl's ``ppo_max_token_len_per_gpu``.

Why: a fixed number of sequences per micro-batch is either too many for long completions
(out of memory) or too few for short ones (slow), and every micro-batch was padded to the
longest sequence of the whole batch. Here the rows are sorted by length (longest first) and
packed greedily: a micro-batch takes the next row while ``rows x (longest prompt + longest
completion)`` of the micro-batch stays within the budget (and its rows within
``train.micro_batch_size``); each micro-batch is then cut to its own widths (all-padding
prompt columns on the left and completion columns on the right are dropped), so its forward
and its saved activations cost what its own tokens cost.

Numerics: the loss is micro-batch invariant because its aggregation divides by the
optimizer batch's global token / sequence counts (:func:`portarl.core.compute_loss`), not
by the micro-batch's; dropped columns are padding (masked keys, zero-weight tokens; position
ids come from the attention mask and do not move). So any budget gives the one-micro-batch
gradient within fp32 rounding (``tests/trainer/test_memory_micro_batches.py``).

A row longer than the budget gets a micro-batch of its own (it cannot be split: the
forward needs the whole sequence), and a warning names the setting (once per trainer).

Several ranks (FSDP2): every forward is collective, so every rank must run the same number
of micro-batches; the count is all-reduced (max) and a rank with fewer splits its largest
micro-batches in halves until it has as many (halves stay within the budget).

Padding-free (``train.padding_free``, :mod:`portarl.trainer.phases.packing`): the budget counts
the tokens the packed forward computes, not the padded width: the real tokens (the one-row
varlen layout), or the real tokens plus the unused tails of the rows they are packed into
(the rows layout of mask-based attention); each micro-batch carries its packed layout
(``TokenBatch.packed``) for the forwards.

Host syncs: one read of the rows' lengths per call (and one all-reduce under torchrun), not
one per micro-batch. ``max_tokens_per_micro_batch=None`` keeps the fixed
``micro_batch_size`` slices (no sort, no trim, and without padding-free no sync).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from portarl.runtime import distributed as pdist
from portarl.trainer.phases.attention_masks import causal_rows
from portarl.trainer.phases.pack_rows import first_fit
from portarl.trainer.phases.packing import pack_micro_batch
from portarl.trainer.phases.sequences import TokenBatch

log = logging.getLogger("portarl.train")


class _Tokens:
    """The tokens a micro-batch's forward computes as rows are added longest first:
    padded, ``rows x (max prompt + max completion)``; ``"varlen"``, the real tokens (one
    row); ``"rows"``, the packed rows (first fit into rows as long as the first, longest,
    sequence: :func:`portarl.trainer.phases.pack_rows.first_fit_rows` places them the same way) x
    that length: real tokens plus the rows' unused tails, an upper bound of what
    :func:`portarl.trainer.phases.pack_rows.choose_rows` computes."""

    def __init__(self, layout: str | None, causal=None):
        self.layout = layout
        self.causal = causal  # (rows, width) -> whether those rows become causal rows (one sequence each)
        self.width_p = self.width_c = self.total = self.capacity = 0
        self.room: list[int] = []
        self.rows = 0

    def with_row(self, p: int, c: int) -> int:
        """The tokens with one more row of ``p`` prompt and ``c`` completion tokens."""
        if self.layout == "varlen":
            return self.total + p + c
        if self.layout == "rows":
            capacity = self.capacity or p + c
            rows = len(self.room) + (first_fit(self.room, p + c) is None)
            if self.causal is not None and self.causal(rows, capacity):
                return (self.rows + 1) * capacity  # one sequence per row (attention_masks.causal_rows)
            return capacity * rows
        return (self.rows + 1) * (max(self.width_p, p) + max(self.width_c, max(1, c)))

    def add(self, p: int, c: int) -> None:
        n = p + c
        self.rows += 1
        self.total += n
        self.width_p, self.width_c = max(self.width_p, p), max(self.width_c, max(1, c))
        if self.layout == "rows":
            self.capacity = self.capacity or n
            r = first_fit(self.room, n)
            if r is None:
                self.room.append(self.capacity - n)
            else:
                self.room[r] -= n


def pack(prompt_lens: list[int], completion_lens: list[int], max_rows: int, max_tokens: int, *,
         layout: str | None = None, causal=None) -> list[list[int]]:
    """Row indices of each micro-batch: rows sorted by total length, longest first, taken
    greedily while the tokens the micro-batch's forward computes stay <= ``max_tokens``
    (``layout``: None padded, ``"rows"`` / ``"varlen"`` padding-free; :class:`_Tokens`)
    and its rows <= ``max_rows`` (``causal``: the rows layout's fallback to one sequence per
    row, :func:`portarl.trainer.phases.attention_masks.causal_rows`). A row alone over the budget is a micro-batch of its own.
    Each micro-batch's indices are in ascending order (the batch's own order within it)."""
    n = len(prompt_lens)
    if layout is not None and n <= max_rows and n * max(map(sum, zip(prompt_lens, completion_lens)), default=0) \
            <= max_tokens:  # padding-free computes at most rows x the longest: everything fits
        return [list(range(n))] if n else []
    order = sorted(range(n), key=lambda i: (-(prompt_lens[i] + completion_lens[i]), i))
    parts: list[list[int]] = []
    current: list[int] = []
    tokens = _Tokens(layout, causal)
    for i in order:
        p, c = prompt_lens[i], completion_lens[i]
        if current and (len(current) + 1 > max_rows or tokens.with_row(p, c) > max_tokens):
            parts.append(sorted(current))
            current, tokens = [], _Tokens(layout, causal)
        current.append(i)
        tokens.add(p, c)
    if current:
        parts.append(sorted(current))
    return parts


def split_to(parts: list[list[int]], count: int) -> list[list[int]]:
    """``parts`` with its largest micro-batches split in halves until there are ``count``
    (ranks must run the same number of forwards). ``count`` <= total rows."""
    parts = [list(p) for p in parts]
    while len(parts) < count:
        k = max(range(len(parts)), key=lambda j: len(parts[j]))
        if len(parts[k]) < 2:
            raise ValueError(f"cannot split {sum(map(len, parts))} rows into {count} micro-batches")
        half = len(parts[k]) // 2
        parts[k:k + 1] = [parts[k][:half], parts[k][half:]]
    return parts


def trimmed(batch: TokenBatch, rows: torch.Tensor, width_p: int, width_c: int) -> TokenBatch:
    """``rows`` of ``batch`` with only the last ``width_p`` prompt columns and the first
    ``width_c`` completion columns (the rest is padding for every one of these rows)."""
    start, end = batch.prompt_width - width_p, batch.prompt_width + width_c
    vision = None if batch.vision is None else batch.vision.rows(rows).columns(start, end)
    routing = None if batch.routing is None else batch.routing.rows(rows).columns(start, end)
    return TokenBatch(batch.input_ids[rows, start:end], batch.attention_mask[rows, start:end],
                      batch.position_ids[rows, start:end], batch.labels[rows, :width_c], batch.mask[rows, :width_c],
                      width_p, vision=vision, routing=routing)


def micro_batches(trainer, batch: TokenBatch) -> list[tuple[torch.Tensor | slice, TokenBatch]]:
    """``(rows, micro-batch)`` pairs covering ``batch``: fixed ``micro_batch_size`` slices
    when ``train.max_tokens_per_micro_batch`` is None, else token-budget packs (module
    docstring). ``micro-batch.labels.shape[1]`` says how many completion columns it kept:
    per-row tensors of the batch go through :func:`rows_of`."""
    cfg = trainer.config.train
    n = batch.labels.shape[0]
    budget = getattr(cfg, "max_tokens_per_micro_batch", None)
    sp_size = getattr(getattr(trainer, "sp", None), "size", 1)
    if budget is not None:  # per rank: under sequence parallelism each rank computes 1 / SP of a row
        budget *= sp_size
    packing = getattr(trainer, "padding_free", None)  # a packing.Layout, or None: padded (GRPOTrainer.__init__)
    if budget is None and packing is None:
        return [(slice(i, i + cfg.micro_batch_size), batch.rows(slice(i, i + cfg.micro_batch_size)))
                for i in range(0, n, cfg.micro_batch_size)]
    p_width = batch.prompt_width
    # Tokens by the attention mask, not the labels: a completion may hold tokens that are not
    # scored (label -100 inside it, e.g. a tool's output in a multi-turn sample).
    attention = batch.attention_mask
    lengths = torch.stack([attention[:, :p_width].sum(-1), attention[:, p_width:].sum(-1)]).tolist()
    prompt_lens, completion_lens = lengths
    if budget is None:
        parts = [list(range(i, min(n, i + cfg.micro_batch_size))) for i in range(0, n, cfg.micro_batch_size)]
    else:
        parts = pack(prompt_lens, completion_lens, cfg.micro_batch_size, budget,
                     layout=None if packing is None else packing.kind,
                     causal=None if packing is None else functools.partial(causal_rows, layout=packing))
        _warn_over_budget(trainer, budget // sp_size, [-(-p // sp_size) for p in prompt_lens],
                          [-(-c // sp_size) for c in completion_lens])
        dist = trainer.dist
        if dist.enabled:
            count = pdist.all_reduce(dist, torch.tensor([float(len(parts))]), op=torch.distributed.ReduceOp.MAX)
            parts = split_to(parts, int(count.item()))
    keys = None
    if packing is not None and packing.share_prompt:  # each row's prompt tokens: equal ones are shared
        prompts = batch.input_ids[:, :p_width].tolist()
        keys = [tuple(row[p_width - p:]) for row, p in zip(prompts, prompt_lens)]
        if batch.vision is not None:  # equal tokens with other images are other prompts
            keys = [key + (("vision", k),) for key, k in zip(keys, batch.vision.prompt_keys)]
        if batch.routing is not None:  # routing replay: equal tokens the engine routed otherwise are other prompts
            keys = [key + (("experts", k),) for key, k in zip(keys, batch.routing.prompt_keys(p_width, prompt_lens))]
    out = []
    for part in parts:
        rows = torch.tensor(part, dtype=torch.long, device=batch.labels.device)
        p_lens, c_lens = [prompt_lens[i] for i in part], [completion_lens[i] for i in part]
        micro = trimmed(batch, rows, max(p_lens), max(max(1, c) for c in c_lens))
        if packing is not None:
            micro = dataclasses.replace(micro, packed=pack_micro_batch(
                micro, p_lens, c_lens, packing, None if keys is None else [keys[i] for i in part]))
        out.append((rows, micro))
    return out


def _warn_over_budget(trainer, budget: int, prompt_lens: list[int], completion_lens: list[int]) -> None:
    """Once per run. The advice never names a budget past the model's context: no sequence
    of a sound batch is longer (multi-turn episodes stop before it), and one that is must
    not read as a budget to configure."""
    longest = max((p + max(1, c) for p, c in zip(prompt_lens, completion_lens)), default=0)
    if longest <= budget or getattr(trainer, "budget_warned", False):
        return
    trainer.budget_warned = True
    context = getattr(getattr(getattr(trainer, "model", None), "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and longest > context:
        log.warning("a sequence of %d tokens is longer than the model's context (%d positions), and longer than "
                    "train.max_tokens_per_micro_batch=%d: it runs as a micro-batch of its own; a raised budget "
                    "would not change that (what made it, not the budget, needs fixing)", longest, context, budget)
        return
    log.warning("train.max_tokens_per_micro_batch=%d is below the longest sequence (%d tokens): each such "
                "sequence runs as a micro-batch of its own; raise the budget to at least %d", budget, longest, longest)


def rows_of(value: torch.Tensor | None, rows, part: TokenBatch) -> torch.Tensor | None:
    """``value[rows]`` cut to the micro-batch's completion columns (per-sequence tensors
    [B] are only indexed)."""
    if value is None:
        return None
    value = value[rows]
    return value[:, : part.labels.shape[1]] if value.dim() > 1 else value


__all__ = ["micro_batches", "pack", "rows_of", "split_to", "trimmed"]
