"""Shared-prompt packing (``train.share_prompt``): the G samples of a group share their
prompt, so a padding-free row holds the prompt once, then each completion, under an
explicit attention mask (the "Prefix Grouper" idea for GRPO).

Why: the training forward (and the no-grad scoring forwards) otherwise compute the
prompt's tokens G times. With 8 samples of 8 tokens after a 4-token prompt, a group is
4 + 8 x 7 = 60 tokens instead of 96 (the last token of each completion is dropped too: it
is only a label, the position after it predicts nothing scored).

Layout of one group (a "unit") in a row: the prompt's p tokens at positions 0..p-1, then
completion k's first c_k - 1 tokens at positions p..p+c_k-2. The mask
(:func:`shared_mask`): a prompt token attends causally to the prompt; a token of
completion k attends to the whole prompt and causally to completion k's own tokens, never
to another completion nor another unit. Completion k's first token is scored from the
prompt's last position (shared by the group), its later tokens from its own positions.
Each sequence so sees exactly its own tokens at its own positions: log-probs, entropy and
gradients equal the padded path's within fp32 rounding (the prompt's gradients are the
sum over the group, as in the padded layout; ``tests/trainer/test_share_prompt.py``).

Rows whose prompts are equal token for token are one group (no group ids needed: equal
prompts have equal hidden states). A group is shared only where the model's cost
(:func:`portarl.trainer.phases.pack_rows.row_cost`: a dense mask computes every query-key
pair of a row) is lower than its sequences' own; and the micro-batch's shared layout is
used only where it computes no more tokens and costs no more than the unshared packing
(so the token budget, counted for unshared rows, still bounds it).

Supported: attention that takes a custom 4-D mask as is (transformers'
``_preprocess_mask_arguments`` returns a 4-D mask unchanged): ``sdpa`` (a boolean mask,
True = attend), ``eager`` (an additive mask in the model's dtype, as transformers'
``eager_mask`` builds it) and ``flex_attention`` (a BlockMask from the same unit and part
ids, :func:`portarl.trainer.phases.attention_masks.block_mask`: no dense mask). Not flash
attention (varlen kernels take spans, not masks). A dense mask over
:data:`portarl.trainer.phases.attention_masks.DENSE_MASK_BOUND_BYTES` is never built: such
a micro-batch is not shared (logged once) and packs as unshared rows.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from portarl.trainer.phases import attention_masks as masks
from portarl.trainer.phases.pack_rows import choose_rows, row_cost

log = logging.getLogger("portarl.train")

#: Attention implementations that take a custom 4-D mask (flex: a BlockMask) unchanged.
SHARE_ATTENTION = ("sdpa", "eager", "flex_attention")


def resolve_share_prompt(cfg, model, layout):
    """``layout`` (a :class:`portarl.trainer.phases.packing.Layout` or None) with
    ``share_prompt`` set from ``train.share_prompt``: false -> unchanged; auto -> on where
    supported; true -> on, or ConfigError naming why it cannot be."""
    value = getattr(cfg.train, "share_prompt", False)
    if value is False:
        return layout
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is None:
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        impl = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if layout is None:
        why = "train.padding_free is off or unsupported for this model"
    elif layout.kind != "rows" or impl not in SHARE_ATTENTION:
        why = f"attention {impl!r} does not take a custom 4-D mask (supported: {', '.join(SHARE_ATTENTION)})"
    else:
        dtype = None
        if impl == "eager":
            dtype = model.get_input_embeddings().weight.dtype
        return dataclasses.replace(layout, share_prompt=True, mask_dtype=dtype)
    if value is True:
        from portarl.trainer.config.fields import ConfigError

        raise ConfigError(f"train.share_prompt=true needs mask-based attention on padding-free rows: {why}; set "
                          "train.share_prompt=auto or false")
    log.debug("shared-prompt packing: off (%s)", why)
    return layout


def shared_mask(seg: torch.Tensor, sub: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """[rows, 1, W, W] attention mask from per-token unit ids ``seg`` and part ids ``sub``
    [rows, W] (0: the unit's prompt, k: its completion k): query q sees key j <= q of its
    unit when j is a prompt token or of q's own part. Boolean (True = attend) for
    ``dtype`` None, else additive (0 / the dtype's min)."""
    w = seg.shape[1]
    causal = torch.ones(w, w, dtype=torch.bool, device=seg.device).tril()
    same_unit = seg[:, :, None] == seg[:, None, :]
    visible = (sub[:, None, :] == 0) | (sub[:, :, None] == sub[:, None, :])
    mask = (same_unit & visible & causal)[:, None]
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=seg.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _units(prompt_lens, completion_lens, keys, layout) -> list[list[int]]:
    """Rows of the micro-batch grouped into units: equal prompts share one where it is
    cheaper (module docstring), every other row is a unit of its own. First-appearance order."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    units = []
    for rows in groups.values():
        shared = unit_length(rows, prompt_lens, completion_lens)
        alone = sum(row_cost(1, unit_length([i], prompt_lens, completion_lens), layout) for i in rows)
        if len(rows) > 1 and prompt_lens[rows[0]] and row_cost(1, shared, layout) < alone:
            units.append(rows)
        else:
            units.extend([i] for i in rows)
    return units


def unit_length(unit: list[int], prompt_lens, completion_lens) -> int:
    """The tokens a unit feeds: its prompt once and each completion but its last token."""
    return prompt_lens[unit[0]] + sum(max(completion_lens[i] - 1, 0) for i in unit)


def pack_shared(part, prompt_lens: list[int], completion_lens: list[int], keys: list, layout,
                bound: tuple[int, int]) -> tuple | None:
    """The shared-prompt :class:`portarl.trainer.phases.packing.Packed` layout of ``part`` (see
    :func:`portarl.trainer.phases.packing.pack_micro_batch` for the arguments; ``keys``:
    each row's prompt tokens, equal for rows of a group), or None where it would compute
    more tokens or cost more than the unshared rows ``bound`` = (rows, width). Returned as
    the Packed fields ``(input_ids, position_ids, scored, where, attention_mask, source, row_tokens)``."""
    units = _units(prompt_lens, completion_lens, keys, layout)
    lengths = [unit_length(u, prompt_lens, completion_lens) for u in units]
    rows = choose_rows(lengths, layout)
    row_width = max(sum(lengths[u] for u in r) for r in rows)
    if len(rows) * row_width > bound[0] * bound[1] or \
            row_cost(len(rows), row_width, layout) > row_cost(bound[0], bound[1], layout):
        return None
    if not masks.fits(len(rows), row_width, layout):
        masks.log_once("share-over-bound", "shared-prompt rows: not shared where the mask of %d rows of %d tokens "
                       "(%.0f MiB) is over the %d MiB bound; such micro-batches pack unshared", len(rows), row_width,
                       masks.mask_bytes(len(rows), row_width, layout) / 2**20, masks.DENSE_MASK_BOUND_BYTES >> 20)
        return None
    width, t, pw = part.input_ids.shape[1], part.labels.shape[1], part.prompt_width
    src: list[int] = []
    pos: list[int] = []
    seg: list[int] = []
    sub: list[int] = []
    scored: list[int] = []
    where: list[int] = []
    real: list[int] = []
    unit_id = 0
    for r, row in enumerate(rows):
        offset = r * row_width
        for u in row:
            members = units[u]
            p = prompt_lens[members[0]]
            start = members[0] * width + pw - p  # the prompt's first token in the padded layout
            src.extend(range(start, start + p))
            pos.extend(range(p))
            seg.extend([unit_id] * p)
            sub.extend([0] * p)
            last = offset + p - 1  # the prompt's last position scores every first completion token
            offset += p
            for k, i in enumerate(members, 1):
                c = completion_lens[i]
                if not c:
                    continue
                n = c - 1
                scored.append(last)
                scored.extend(range(offset, offset + n))
                where.extend(range(i * t, i * t + c))
                start = i * width + pw
                src.extend(range(start, start + n))
                pos.extend(range(p, p + n))
                seg.extend([unit_id] * n)
                sub.extend([k] * n)
                offset += n
            unit_id += 1
        real.append(offset - r * row_width)
        tail = (r + 1) * row_width - offset  # the row's unused tail: a unit of its own
        src.extend([0] * tail)
        pos.extend(range(tail))
        seg.extend([unit_id] * tail)
        sub.extend([0] * tail)
        unit_id += 1
    device = part.input_ids.device
    host = torch.tensor(src + pos + seg + sub + scored + where, dtype=torch.long).to(device, non_blocking=True)
    n = len(src)
    src_t, pos_t, seg_t, sub_t, scored_t, where_t = host.split([n, n, n, n, len(scored), len(where)])
    shape = (len(rows), row_width)
    ids = part.input_ids.reshape(-1)[src_t].view(shape)
    if masks.mask_kind(layout) == "block":
        mask = masks.block_mask(seg_t.view(shape), sub_t.view(shape))
    else:
        mask = shared_mask(seg_t.view(shape), sub_t.view(shape), layout.mask_dtype)
    return ids, pos_t.view(shape), scored_t, where_t, mask, src_t, real


__all__ = ["SHARE_ATTENTION", "pack_shared", "resolve_share_prompt", "shared_mask", "unit_length"]
