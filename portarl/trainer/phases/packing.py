"""Padding-free micro-batches (``train.padding_free``): a micro-batch's sequences
concatenated without pad tokens, position ids restarting at 0 for every sequence, through
the model's own packed-sequence path in transformers.

Why: a padded micro-batch is as wide as its longest prompt plus its longest completion,
and with mixed completion lengths (the normal case with reasoning) the padded share of
every forward and backward is work thrown away. verl (``use_remove_padding``), OpenRLHF,
slime, MindSpeed-RL and others train padding-free.

How transformers (5.x) runs a packed sequence, and what portarl hands it:

- mask-based attention (``sdpa``, ``eager``, ``flex_attention``):
  ``masking_utils._preprocess_mask_arguments`` calls ``find_packed_sequence_indices`` on
  ``position_ids`` when the 2-D ``attention_mask`` is None and there is no KV cache; a
  position that does not follow its left neighbour by 1 starts a new sequence, and the
  causal mask is intersected with "same sequence" (block-diagonal). portarl passes
  ``attention_mask=None`` and ``use_cache=False`` (with the default ``use_cache=True`` the
  model makes a cache and the packed mask is silently *not* built: tokens would attend
  across sequences). The mask is dense (SDPA computes every query-key pair of a row), so
  one long row would cost the square of the micro-batch's tokens in attention (36x the
  padded layout's attention time for 64 sequences of 100 tokens on CPU): sequences go
  into rows (first-fit decreasing) whose length :func:`portarl.trainer.phases.pack_rows.choose_rows`
  picks from the model's own per-token costs (linear maps against attention), never
  computing more tokens than rows as long as the longest sequence would. A row's unused
  tail is its own segment (positions 0, 1, ...) that nothing attends to. No mask over
  :data:`portarl.trainer.phases.attention_masks.DENSE_MASK_BOUND_BYTES` is built
  (:mod:`portarl.trainer.phases.attention_masks`): ``flex_attention`` gets a BlockMask
  portarl builds from the same segments; ``sdpa`` rows over the bound become "causal rows"
  (one sequence per row, the tail continuing its positions: transformers then finds no
  packed sequence and builds no mask, ``is_causal``).
- varlen attention (``flash_attention_2/3/4``): one row for the whole micro-batch, with
  ``cu_seq_lens_q/k`` and ``max_length_q/k`` (transformers' ``FlashAttentionKwargs``, as its
  ``DataCollatorWithFlattening`` passes them), so ``_flash_attention_forward`` calls
  ``flash_attn_varlen_func`` without deriving them from the position ids. On CUDA that is
  flash-attn's varlen kernel; on Ascend transformers maps ``flash_attention_2`` to
  ``npu_fusion_attention`` with the TND layout and ``actual_seq_qlen`` from the same
  cumulative lengths (``transformers.integrations.npu_flash_attention``). Select it with
  ``model.attn_implementation: flash_attention_2``. Not run on this project's CPU
  machines: the selection is tested, the kernels are transformers'.

Shared-prompt rows (``train.share_prompt``, :mod:`portarl.trainer.phases.share_prompt`): on
the "rows" layout, a group's samples hold their prompt once, under an explicit 4-D mask
(``Packed.attention_mask``, which transformers uses as is: dense, or flex's BlockMask)
instead of the mask derived from the position ids.

Any other attention implementation (a custom registered one, ``paged|...``) or a model
whose modeling code does not build its masks through ``masking_utils.create_causal_mask``
would let tokens attend across sequences: :func:`packing_support` names why, and
``padding_free=auto`` keeps the padded layout (logged once) while ``true`` refuses.

Numerics: each sequence sees exactly its own tokens at the positions it has in the padded
layout, so log-probs (and gradients) equal the padded path's within fp32 rounding
(``tests/trainer/test_padding_free.py``). The completion grid the rest of the step works on
([rows, completion columns]: labels, loss mask, old / reference log-probs) is unchanged;
only the forward is packed, and only the positions that score a completion token reach the
lm head. The loss mask stays the batch's own (any per-token mask, not "every completion
token").
"""

from __future__ import annotations

import dataclasses
import inspect
import logging

import torch

from portarl.trainer.phases import attention_masks as masks
from portarl.trainer.phases.pack_rows import choose_rows
from portarl.trainer.phases.share_prompt import pack_shared, resolve_share_prompt

log = logging.getLogger("portarl.train")

#: transformers builds a block-diagonal causal mask from restarting position ids for these.
MASK_ATTENTION = ("sdpa", "eager", "flex_attention")
#: These run transformers' varlen flash path (flash-attn on CUDA, npu_fusion_attention TND on Ascend).
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


@dataclasses.dataclass
class Packed:
    """The packed forward's inputs for one micro-batch and where its outputs go.

    ``input_ids`` / ``position_ids`` [rows, width]: sequences back to back, positions
    restarting at 0; ``scored`` [K]: flat indices (into rows x width) of the hidden states
    that score completion tokens; ``where`` [K]: the same tokens' flat indices in the
    micro-batch's completion grid [B, T]; ``cu_seq_lens`` / ``max_length``: the varlen
    layout (one row) for flash attention, else None."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    scored: torch.Tensor
    where: torch.Tensor
    cu_seq_lens: torch.Tensor | None = None
    max_length: int | None = None
    #: [rows, 1, W, W]: shared-prompt rows (share_prompt.py), or flex's BlockMask (attention_masks.py)
    attention_mask: object = None
    #: [rows x width]: each packed token's flat index in the padded micro-batch (what
    #: :mod:`portarl.vision.inputs` gathers a vision prompt's M-RoPE positions by)
    source: torch.Tensor | None = None
    #: Per packed row, its real tokens (a prefix; the rest is the row's unused tail)
    row_tokens: list | None = None

    def real(self) -> torch.Tensor:
        """bool [rows x width]: the packed tokens that are sequences' tokens, not a row's tail."""
        rows, width = self.input_ids.shape
        if self.row_tokens is None:
            return torch.ones(rows * width, dtype=torch.bool, device=self.input_ids.device)
        counts = torch.tensor(self.row_tokens, device=self.input_ids.device)
        return (torch.arange(width, device=counts.device)[None, :] < counts[:, None]).reshape(-1)

    def forward_kwargs(self) -> dict:
        kwargs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                  "position_ids": self.position_ids, "use_cache": False}
        if self.cu_seq_lens is not None:
            kwargs.update(cu_seq_lens_q=self.cu_seq_lens, cu_seq_lens_k=self.cu_seq_lens,
                          max_length_q=self.max_length, max_length_k=self.max_length)
        return kwargs


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the trainer packs (``GRPOTrainer.padding_free``): ``kind`` ``"varlen"`` (one
    row, cumulative lengths) or ``"rows"`` (rows under a dense block-diagonal mask). For
    "rows", the model's multiply-adds per token in one decoder layer's linear maps
    (``linear``) and per attended key (``attention``), from which the row length is
    chosen; ``longest_only``: rows no longer than the longest sequence (eager attention
    keeps each row's [heads, width, width] weights for the backward); ``share_prompt``:
    rows hold a group's prompt once (:mod:`portarl.trainer.phases.share_prompt`) under a
    4-D mask, boolean (``mask_dtype`` None) or additive in ``mask_dtype``; ``impl``: the
    model's attention implementation, which decides the mask a row gets and its bound
    (:mod:`portarl.trainer.phases.attention_masks`)."""

    kind: str
    linear: int = 1
    attention: int = 0
    longest_only: bool = False
    share_prompt: bool = False
    mask_dtype: torch.dtype | None = None
    impl: str | None = None


def layout_of(config, kind: str) -> Layout:
    """The :class:`Layout` of a model with transformers ``config`` (Llama / Qwen2 names;
    a standard transformer's 12 H^2 and 2 H where they are missing)."""
    h = int(getattr(config, "hidden_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    if not h or not heads:
        return Layout(kind, impl=getattr(config, "_attn_implementation", None))
    d = int(getattr(config, "head_dim", None) or h // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    mlp = int(getattr(config, "intermediate_size", None) or 4 * h)
    linear = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * mlp
    impl = getattr(config, "_attn_implementation", None)
    return Layout(kind, linear=linear, attention=2 * heads * d, longest_only=impl == "eager", impl=impl)


def _hf_base(model):
    get_base = getattr(model, "get_base_model", None)  # peft
    return get_base() if callable(get_base) else model


def packing_support(model) -> tuple[str | None, str]:
    """``(kind, why)``: ``"rows"`` (mask-based attention: rows bounded by the longest
    sequence), ``"varlen"`` (flash attention: one row with cumulative lengths) or None
    (not supported; ``why`` says what), for ``model`` (a transformers model, peft- or
    FSDP2-wrapped)."""
    base = _hf_base(model)
    config = getattr(base, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    name = type(base).__name__
    try:
        decoder = base.get_decoder()
    except (AttributeError, NotImplementedError):
        return None, f"{name} has no decoder to pack sequences for"
    from transformers import masking_utils

    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        import transformers

        return None, f"transformers {transformers.__version__} does not detect packed sequences (5.x does)"
    builds_masks = any(inspect.getmodule(cls) is not None
                       and getattr(inspect.getmodule(cls), "create_causal_mask", None) is masking_utils.create_causal_mask
                       for cls in type(decoder).__mro__)
    if not builds_masks:
        return None, (f"{type(decoder).__name__} does not build its attention mask with transformers' "
                      "masking_utils.create_causal_mask, which detects packed sequences")
    if impl in VARLEN_ATTENTION:
        return "varlen", f"attention {impl!r}: transformers' varlen path (cu_seq_lens)"
    if impl in MASK_ATTENTION:
        return "rows", f"attention {impl!r}: block-diagonal causal mask from the position ids"
    return None, (f"attention implementation {impl!r} has no packed-sequence support in transformers (supported: "
                  f"{', '.join(MASK_ATTENTION + VARLEN_ATTENTION)})")


def resolve_padding_free(cfg, model) -> Layout | None:
    """The :class:`Layout` the trainer packs with (:func:`packing_support`), or None for
    the padded layout: ``train.padding_free`` false -> None; auto -> the model's layout, or
    None with one log line saying why; true -> the layout, or ConfigError naming the setting.
    A flex-attention model on a device without FlexAttention's backward is refused first
    (:func:`portarl.trainer.phases.attention_masks.refuse_untrainable_flex`)."""
    masks.refuse_untrainable_flex(_hf_base(model))
    value = cfg.train.padding_free
    if value is False:
        return resolve_share_prompt(cfg, model, None)  # share_prompt=true without packing: refused
    kind, why = packing_support(model)
    if kind is not None:
        log.debug("padding-free micro-batches: on (%s)", why)  # the default: no line (errors stay one line)
        return resolve_share_prompt(cfg, model, layout_of(_hf_base(model).config, kind))
    if value is True:
        from portarl.trainer.config.fields import ConfigError

        raise ConfigError(f"train.padding_free=true: {why}; set train.padding_free=auto (padded where unsupported) "
                         "or false, or model.attn_implementation=sdpa")
    resolve_share_prompt(cfg, model, None)  # share_prompt=true without packing: refused
    log.info("padding-free micro-batches: off, padded instead (%s; train.padding_free=auto)", why)
    return None


def pack_micro_batch(part, prompt_lens: list[int], completion_lens: list[int], layout: Layout,
                     keys: list | None = None) -> Packed:
    """The :class:`Packed` layout of ``part`` (a padded micro-batch, :class:`~portarl.trainer.
    sequences.TokenBatch`, prompts right-aligned to ``part.prompt_width``) whose row i has
    ``prompt_lens[i]`` prompt and ``completion_lens[i]`` completion tokens. Index
    arithmetic on the host (the lengths are already there), one copy to the device per tensor.
    With ``layout.share_prompt`` and ``keys`` (row i's prompt tokens), rows with equal
    prompts share them where that computes less (:func:`portarl.trainer.phases.share_prompt.pack_shared`)."""
    width = part.input_ids.shape[1]
    t = part.labels.shape[1]
    lengths = [p + c for p, c in zip(prompt_lens, completion_lens)]
    for i, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        if c and not p:
            raise ValueError(f"row {i} of a micro-batch has no prompt token: its first completion token has no "
                             "position to be scored from")
        if c > t or p > part.prompt_width:
            raise ValueError(f"row {i}: {p} prompt + {c} completion tokens do not fit the micro-batch's "
                             f"{part.prompt_width} + {t} columns")
    groups = choose_rows(lengths, layout)
    row_width = max(sum(lengths[i] for i in g) for g in groups)
    if layout.share_prompt and keys is not None:
        shared = pack_shared(part, prompt_lens, completion_lens, keys, layout, (len(groups), row_width))
        if shared is not None:
            ids, positions, scored, where, mask, source, real = shared
            return Packed(ids, positions, scored, where, attention_mask=mask, source=source, row_tokens=real)
    causal = masks.causal_rows(len(groups), row_width, layout)
    if causal:  # one sequence per row, no mask (attention_masks module docstring)
        masks.log_once("causal-rows", "padding-free rows: %d rows of %d tokens would hold a %.0f MiB attention mask "
                       "(over the %d MiB bound): one sequence per row, causal attention without a mask",
                       len(groups), row_width, masks.mask_bytes(len(groups), row_width, layout) / 2**20,
                       masks.DENSE_MASK_BOUND_BYTES >> 20)
        groups = [[i] for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))]
        row_width = max(lengths)
    elif layout.kind == "rows" and not masks.fits(len(groups), row_width, layout):
        masks.log_once("eager-over-bound", "padding-free rows: eager attention holds [rows, heads, W, W] weights and a "
                       "dense mask (%.0f MiB here, over the %d MiB bound) in every layout; set "
                       "model.attn_implementation=sdpa", masks.mask_bytes(len(groups), row_width, layout) / 2**20,
                       masks.DENSE_MASK_BOUND_BYTES >> 20)
    block = layout.kind == "rows" and not causal and masks.mask_kind(layout) == "block"
    src: list[int] = []
    pos: list[int] = []
    scored: list[int] = []
    where: list[int] = []
    real: list[int] = []
    seg: list[int] = []  # flex: each token's segment (sequence or tail) for the BlockMask
    for r, group in enumerate(groups):
        offset = r * row_width
        for i in group:
            p, n = prompt_lens[i], lengths[i]
            start = i * width + part.prompt_width - p  # the row's first real token in the padded layout
            src.extend(range(start, start + n))
            pos.extend(range(n))
            scored.extend(range(offset + p - 1, offset + n - 1))
            where.extend(range(i * t, i * t + n - p))
            if block:
                seg.extend([i] * n)
            offset += n
        real.append(offset - r * row_width)
        tail = (r + 1) * row_width - offset  # the row's unused tail: a segment of its own
        src.extend([0] * tail)
        # Causal rows: the tail continues its sequence's positions (no packed sequence for
        # transformers to find); else it restarts (a segment of its own).
        pos.extend(range(real[-1], real[-1] + tail) if causal else range(tail))
        if block:
            seg.extend([len(lengths)] * tail)
    device = part.input_ids.device
    # One host tensor, one copy to the device, four views of it.
    host = torch.tensor(src + pos + scored + where, dtype=torch.long).to(device, non_blocking=True)
    src_t, pos_t, scored_t, where_t = host.split([len(src), len(pos), len(scored), len(where)])
    ids = part.input_ids.reshape(-1)[src_t].view(len(groups), row_width)
    packed = Packed(ids, pos_t.view(len(groups), row_width), scored_t, where_t, source=src_t, row_tokens=real)
    if block:
        packed.attention_mask = masks.block_mask(torch.tensor(seg, dtype=torch.long).view(len(groups), row_width)
                                                 .to(device, non_blocking=True))
    if layout.kind == "varlen":
        cu = [0]
        for i in groups[0]:
            cu.append(cu[-1] + lengths[i])
        packed.cu_seq_lens = torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True)
        packed.max_length = max(lengths)
    return packed


def scored_labels(batch) -> torch.Tensor:
    """The labels the lm head scores: ``batch.labels`` [B, T], or packed the scored ones [1, K]."""
    if batch.packed is None:
        return batch.labels
    return batch.labels.reshape(-1)[batch.packed.where].unsqueeze(0)


def scored_hidden(batch, hidden: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states that score the completion tokens: padded, the T
    columns after the prompt [B, T, H]; packed, the scored positions [1, K, H]."""
    if batch.packed is None:
        t = batch.labels.shape[1]
        return hidden[:, batch.prompt_width - 1 : batch.prompt_width - 1 + t]
    return hidden.reshape(-1, hidden.shape[-1])[batch.packed.scored].unsqueeze(0)


def to_grid(batch, values: torch.Tensor, fill=0.0) -> torch.Tensor:
    """Per-token ``values`` of :func:`scored_labels`' layout in the completion grid [B, T]
    (``fill`` where there is no completion token); differentiable."""
    if batch.packed is None:
        return values
    flat = values.reshape(-1)
    grid = torch.full((batch.labels.numel(),), fill, dtype=flat.dtype, device=flat.device)
    return grid.index_copy(0, batch.packed.where, flat).view(batch.labels.shape)


__all__ = ["MASK_ATTENTION", "VARLEN_ATTENTION", "Layout", "Packed", "layout_of", "pack_micro_batch",
           "packing_support", "resolve_padding_free", "scored_hidden", "scored_labels", "to_grid"]
