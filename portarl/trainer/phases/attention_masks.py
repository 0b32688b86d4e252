"""The attention masks of padding-free and shared-prompt rows, held under a bound
(:data:`DENSE_MASK_BOUND_BYTES`): no micro-batch's forward holds a [rows, 1, W, W] mask
larger than it.

Why: mask-based attention (``sdpa``, ``eager``) on packed rows takes a dense 4-D mask,
one entry per query-key pair of every row, built by transformers from the restarting
position ids (:mod:`portarl.trainer.phases.packing`) or by portarl for shared-prompt rows
(:func:`portarl.trainer.phases.share_prompt.shared_mask`). Its size is rows x W^2: at long
context the mask, not the model, fills the device (one row of a 10 MB tool output's
2.5M tokens is a 6.25 TB mask).

What each attention implementation is given (``Layout.impl``, the model's
``_attn_implementation``):

- ``flash_attention_2/3/4`` (flash-attn varlen on CUDA; on Ascend transformers maps it to
  ``npu_fusion_attention`` with the TND layout and ``actual_seq_qlen`` /
  ``actual_seq_kvlen`` from the same cumulative lengths): the "varlen" layout, one row
  and ``cu_seq_lens``: no mask at all.
- ``flex_attention``: a :class:`torch.nn.attention.flex_attention.BlockMask` built here
  (:func:`block_mask`) from each token's segment (sequence, or shared-prompt unit and
  part): per 128 x 128 tile, whether it is empty, full or partial, plus the ``mask_mod``
  that decides inside partial tiles. Its size is rows x (W / 128)^2 x 16 bytes, a 4096th
  of the dense bool mask; it is built in chunks of query tiles so that the dense mask is
  never held either. FlexAttention has no backward on CPU in torch 2.13
  (``NotImplementedError``): there it scores (no-grad forwards) but cannot train, and the
  trainer refuses it at start (:func:`refuse_untrainable_flex`).
- ``sdpa``: the dense bool mask while it fits the bound (counted with the additive copy
  SDPA makes of it on every call, which each layer also keeps for its backward: the plan
  counts those); over it, "causal rows": one
  sequence per row, its tail continuing its positions, so transformers finds no packed
  sequence and no padding and passes ``is_causal=True`` with no mask
  (``masking_utils._ignore_causal_mask_sdpa``). Exact: a tail comes after its sequence's
  tokens, so causal attention never lets a real token see it. Such a micro-batch computes
  rows x the longest sequence (never more than the padded layout's rows x (longest prompt
  + longest completion)), and the token budget counts it that way
  (:class:`portarl.trainer.phases.micro_batches._Tokens`). Shared-prompt rows over the
  bound are not shared (their mask cannot be skipped). Logged once.
- ``eager``: its attention holds [rows, heads, W, W] weights by construction (and
  transformers' eager mask is dense in every layout, padded too): the bound cannot hold,
  the rows stay those of the longest sequence, logged once; use ``sdpa``.

The layout's mask memory is counted where the rows are chosen
(:func:`portarl.trainer.phases.pack_rows.choose_rows`: no packing over the bound is
picked) and by ``portarl plan`` (``attention mask``: :func:`planned_mask_bytes`).
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("portarl.train")

#: The largest attention mask (bytes, :func:`mask_bytes`) a padding-free or shared-prompt
#: micro-batch may hold: 64 MiB. For sdpa that is the bool mask and the additive copy SDPA
#: makes of it on every call (``where(mask, 0, -inf)`` in the query's dtype, up to fp32: 5
#: bytes per query-key pair), so one 3664-token row. Why this value: below it one call's
#: mask costs less than one decoder layer's saved activations of the same row for any model
#: with a hidden size of 1024 or more (3664 x 1024 x 4 bytes x the layer's ~12 saved
#: tensors of width >= hidden > 64 MiB), so it never decides whether a run fits; above it
#: the mask grows with the square of the row while everything else grows linearly. Rows
#: over it take the mask-free or block-mask layouts of the module docstring.
DENSE_MASK_BOUND_BYTES = 64 << 20
#: Bytes per query-key pair of a dense sdpa mask: the bool mask (1) and SDPA's additive
#: copy of it in the query's dtype (at most fp32: 4), made on every attention call.
SDPA_MASK_PAIR_BYTES = 5
#: FlexAttention's tile (``torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE``).
BLOCK = 128
#: Query positions x keys evaluated at once while a BlockMask is built (bool elements).
_CHUNK_ELEMENTS = 1 << 24

_logged: set[str] = set()


def log_once(key: str, message: str, *args) -> None:
    """``log.info`` of ``message`` once per process for ``key`` (a fallback's reason)."""
    if key not in _logged:
        _logged.add(key)
        log.info(message, *args)


def mask_kind(layout) -> str:
    """``"none"`` (varlen: spans, no mask), ``"block"`` (flex: a BlockMask) or ``"dense"``."""
    if layout.kind == "varlen":
        return "none"
    return "block" if getattr(layout, "impl", None) == "flex_attention" else "dense"


def eager_like(layout) -> bool:
    """Attention whose own weights are [heads, W, W] and whose mask is always dense (eager)."""
    return getattr(layout, "impl", None) == "eager" or bool(getattr(layout, "longest_only", False))


def mask_bytes(rows: int, width: int, layout) -> int:
    """Bytes of the attention mask of ``rows`` packed rows of ``width`` tokens under ``layout``:
    dense [rows, 1, W, W] (sdpa: bool and SDPA's per-call additive copy,
    :data:`SDPA_MASK_PAIR_BYTES`; eager: additive in ``mask_dtype`` / fp32); a BlockMask's
    four int32 index tensors [rows, 1, W/128, W/128]; none for varlen."""
    kind = mask_kind(layout)
    if kind == "none":
        return 0
    if kind == "block":
        tiles = math.ceil(width / BLOCK)
        return rows * tiles * tiles * 4 * 4
    size = SDPA_MASK_PAIR_BYTES
    if eager_like(layout):
        dtype = getattr(layout, "mask_dtype", None)
        size = dtype.itemsize if dtype is not None else 4
    return rows * width * width * size


def fits(rows: int, width: int, layout) -> bool:
    """Whether the mask of ``rows`` x ``width`` stays within :data:`DENSE_MASK_BOUND_BYTES`."""
    return mask_bytes(rows, width, layout) <= DENSE_MASK_BOUND_BYTES


def causal_rows(rows: int, width: int, layout) -> bool:
    """Whether packed rows of this shape give way to causal rows (one sequence per row, no
    mask): a mask over the bound under ``sdpa`` or flex (module docstring). Eager keeps its
    rows (logged once by :func:`portarl.trainer.phases.packing.pack_micro_batch`)."""
    return layout.kind == "rows" and not eager_like(layout) and not fits(rows, width, layout)


def planned_mask_bytes(impl: str | None, packed: bool, rows: int, width: int, tokens: int, b: int,
                       saving_layers: int) -> int:
    """``portarl plan``'s attention masks of the largest micro-batch's update: ``rows``
    sequences of up to ``width`` tokens (padded), ``tokens`` packed; ``b`` the compute dtype's
    bytes; ``saving_layers`` the decoder layers whose backward is pending at once (all of
    them, or 1 with activation checkpointing). sdpa: the bool mask once and SDPA's additive
    copy in ``b`` saved by every such layer for its backward; padded, transformers' dense
    [rows, 1, S, S]; packed, at most the pairs the bound allows. eager: one additive mask
    in ``b``. flex: a BlockMask. flash: none."""
    impl = impl or "sdpa"
    if impl.startswith("flash_attention"):
        return 0
    if impl == "flex_attention":
        tiles = math.ceil((tokens if packed else width) / BLOCK)
        return (1 if packed else rows) * tiles * tiles * 16
    pairs = rows * width * width
    if impl == "eager":
        return pairs * b
    if packed:
        pairs = min(pairs, DENSE_MASK_BOUND_BYTES // SDPA_MASK_PAIR_BYTES, tokens * tokens)
    return pairs * (1 + b * saving_layers)


def refuse_untrainable_flex(model) -> None:
    """ConfigError (one line, naming the setting) where the model's attention is
    ``flex_attention`` and torch cannot train it on the model's device: no FlexAttention
    backward on CPU in torch 2.13 (``NotImplementedError``), and no FlexAttention at all on
    Ascend NPUs (``ValueError``: torch supports CUDA, CPU, XPU, HPU and MPS; Ascend/pytorch
    issue 147); the first update would otherwise fail inside the model. Probed with torch's
    own checks on a 16-token tensor on that device, so a torch that adds support passes."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    param = next(iter(model.parameters()), None)
    if impl != "flex_attention" or param is None or param.device.type == "meta":
        return
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    q = torch.zeros(1, 1, 16, 16, device=param.device, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile": a probe
            flex_attention(q, q, q)
    except (NotImplementedError, ValueError) as e:
        from portarl.trainer.config.fields import ConfigError

        other = "flash_attention_2 or sdpa" if param.device.type == "npu" else "sdpa"
        raise ConfigError(f"model.attn_implementation=flex_attention: torch {torch.__version__} cannot train it on "
                          f"{param.device.type} ({str(e).splitlines()[0]}); set model.attn_implementation={other}"
                          ) from None


def _visible(seg: torch.Tensor, sub: torch.Tensor | None, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """bool [rows, len(q), len(kv)]: query position q sees key position kv (the mask_mod, batched)."""
    out = (seg[:, q, None] == seg[:, None, kv]) & (kv[None, None, :] <= q[None, :, None])
    if sub is not None:
        out &= (sub[:, None, kv] == 0) | (sub[:, q, None] == sub[:, None, kv])
    return out


def block_mask(seg: torch.Tensor, sub: torch.Tensor | None = None):
    """A flex :class:`~torch.nn.attention.flex_attention.BlockMask` [rows, 1, W, W] for
    segment ids ``seg`` [rows, W] (contiguous runs, ids >= 0; a token sees the earlier
    tokens of its segment) and, for
    shared-prompt rows, part ids ``sub`` (0: the unit's prompt, k: completion k; a token
    sees its unit's prompt and its own part: :func:`portarl.trainer.phases.share_prompt.shared_mask`).

    Tiles are classified exactly (empty / full / partial) by evaluating the mask in chunks
    of query tiles against the keys from their segments' starts up to them (causal), at
    most ``_CHUNK_ELEMENTS`` pairs (over all rows) at a time where a tile pair allows it:
    the dense mask is never held."""
    from torch.nn.attention.flex_attention import BlockMask

    rows, width = seg.shape
    tiles = math.ceil(width / BLOCK)
    padded = tiles * BLOCK
    device = seg.device
    # Positions past the row (the last tile's padding) belong to no segment.
    seg_p = torch.full((rows, padded), -1, dtype=torch.long, device=device)
    seg_p[:, :width] = seg
    sub_p = None
    if sub is not None:
        sub_p = torch.full((rows, padded), -1, dtype=torch.long, device=device)
        sub_p[:, :width] = sub
    any_t = torch.zeros(rows, tiles, tiles, dtype=torch.bool, device=device)
    full_t = torch.zeros(rows, tiles, tiles, dtype=torch.bool, device=device)
    # Segments are contiguous runs: a query sees no key before its run's start, so each
    # query tile is evaluated from the earliest start among its tokens (block-diagonal
    # work, not rows x W^2).
    pos = torch.arange(padded, device=device)
    is_start = torch.ones(rows, padded, dtype=torch.bool, device=device)
    is_start[:, 1:] = seg_p[:, 1:] != seg_p[:, :-1]
    runs = is_start.sum(dim=1)
    if any(int(torch.unique(seg_p[r]).numel()) != int(runs[r]) for r in range(rows)):
        raise ValueError("block_mask: a segment id occurs in two separate runs of a row (segments must be contiguous)")
    start = torch.where(is_start, pos, 0).cummax(dim=1).values
    first_tile = (start.view(rows, tiles, BLOCK).amin(dim=(0, 2)) // BLOCK).tolist()
    q_step = max(1, _CHUNK_ELEMENTS // (rows * BLOCK * padded))
    for t0 in range(0, tiles, q_step):
        t1 = min(tiles, t0 + q_step)
        q = pos[t0 * BLOCK : t1 * BLOCK]
        valid_q = (q < width)[None, :, None]
        kv_step = max(1, _CHUNK_ELEMENTS // (rows * BLOCK * BLOCK * (t1 - t0)))
        for k0 in range(min(first_tile[t0:t1]), t1, kv_step):  # causal: no key after the chunk's last query
            k1 = min(t1, k0 + kv_step)
            seen = _visible(seg_p, sub_p, q, pos[k0 * BLOCK : k1 * BLOCK]) & valid_q
            seen = seen.view(rows, t1 - t0, BLOCK, k1 - k0, BLOCK)
            any_t[:, t0:t1, k0:k1] = seen.any(dim=(2, 4))
            # Full: every pair of the whole 128 x 128 tile visible (a tile holding the row's
            # padding never is, as torch's create_block_mask classifies it).
            full_t[:, t0:t1, k0:k1] = seen.all(dim=(2, 4))
    partial = any_t & ~full_t

    def indices(which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = which.sum(-1, dtype=torch.int32)[:, None]
        order = torch.argsort((~which).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]
        return count, order

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full_t)

    if sub is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (seg[b, q_idx] == seg[b, kv_idx]) & (kv_idx <= q_idx)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return ((seg[b, q_idx] == seg[b, kv_idx]) & (kv_idx <= q_idx)
                    & ((sub[b, kv_idx] == 0) | (sub[b, q_idx] == sub[b, kv_idx])))

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(width, width))


__all__ = ["BLOCK", "DENSE_MASK_BOUND_BYTES", "block_mask", "causal_rows", "eager_like", "fits", "log_once",
           "mask_bytes", "mask_kind", "planned_mask_bytes", "refuse_untrainable_flex"]
