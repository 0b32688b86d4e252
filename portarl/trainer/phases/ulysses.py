"""Ulysses sequence parallelism in the trainer's forwards (``train.sequence_parallel_size``).

Every rank of a sequence-parallel group (:mod:`portarl.runtime.sequence_parallel`) holds the
same micro-batch. Its rows (padded, or padding-free packed rows) are padded on the right
to a multiple of SP tokens and cut into SP contiguous shards; rank r runs the model on
shard r only: embeddings, RoPE (from the full row's position ids of its tokens), the
linear maps and the MLP on W / SP tokens. Around attention an all-to-all turns
[W / SP tokens, all heads] into [W tokens, heads / SP], attention runs over the whole row
under the whole row's mask, and a second all-to-all turns it back (DeepSpeed-Ulysses).

How the attention is reached: transformers 5.x's attention modules look their function up
in ``ALL_ATTENTION_FUNCTIONS`` at every forward and pass it the forward's keyword
arguments. :func:`install_attention` registers, for ``sdpa`` and the varlen (flash)
implementations, a function that calls the original unless the forward carries
:data:`SP_KWARG`, the micro-batch's :class:`_RowAttention` (its group, shard length and the
whole rows' attention pattern); with it, the all-to-all path runs. The state rides in the
forward's arguments, so activation checkpointing's recomputation during backward takes the
same path, and every other forward (generation, the SFT warm-up) is untouched. The decoder
is given ``attention_mask`` as a mapping of ``None`` per layer type (transformers uses a
dict as the prepared masks), so no mask is built for the shard. The whole rows' pattern:
causal, within the sequence (a position id that does not follow its left neighbour starts
one, as transformers' ``find_packed_sequence_indices`` decides), real keys only, or a
shared-prompt row's own 4-D mask. Under ``sdpa`` that is a bool mask (:func:`row_mask`;
padding-free rows over :data:`portarl.trainer.phases.attention_masks.DENSE_MASK_BOUND_BYTES`
arrive as one sequence per row, so it is None: plain causal); under flash it is the rows'
spans (:func:`row_spans`), handed to the original flash function as transformers'
padding-free ``cu_seq_lens`` keywords: flash-attn's varlen kernel on CUDA,
``npu_fusion_attention`` with ``actual_seq_qlen`` on Ascend (transformers' NPU flash
integration), no [W, W] tensor in any layout. Never a silent no-op: a forward whose
attention did not run through the all-to-all in every layer, or whose hidden states are not
W / SP tokens, raises.

GQA: with ``num_key_value_heads`` not a multiple of SP, each key / value head is repeated
``SP / gcd(kv, SP)`` times before the all-to-all (as verl does); that factor divides the
query heads per key / value head whenever SP divides the query heads, so every query head
keeps its own key / value head. SP not dividing ``num_attention_heads`` is refused
(:func:`sequence_parallel_refusal`).

Labels are the next tokens of the whole row, placed at the positions that score them
before the row is cut, so a token at a shard boundary is scored by the last position of
the shard before it. Each rank scores the tokens whose scoring position is in its shard
with the fused :func:`portarl.ops.linear_logprobs` (log-probs and entropy), the group sums
the entries (each filled by one rank: :func:`portarl.runtime.sequence_parallel.sum_over_group`,
whose backward passes the gradient through) into the completion grid, and every rank of
the group computes the same loss from them; the sum of the group's gradients is that
loss's gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from portarl import ops
from portarl.runtime.sequence_parallel import SPGroup, all_to_all, sum_over_group
from portarl.trainer.phases.packing import VARLEN_ATTENTION, to_grid
from portarl.trainer.phases.sequences import _HeadPassthrough, _is_sharded

#: The forward keyword that carries a micro-batch's :class:`_RowAttention` to the attention.
SP_KWARG = "portarl_sequence_parallel"


def install_attention() -> None:
    """Register the sequence-parallel ``sdpa`` and varlen (flash) attention (idempotent;
    module docstring)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in ("sdpa", *VARLEN_ATTENTION):
        if name in ALL_ATTENTION_FUNCTIONS:
            ALL_ATTENTION_FUNCTIONS.register(name, _wrapped(ALL_ATTENTION_FUNCTIONS[name], varlen=name != "sdpa"))


def _wrapped(original, *, varlen: bool):
    if getattr(original, "_portarl_ulysses", False):
        return original

    def attention_or_ulysses(module, query, key, value, attention_mask, *args, **kwargs):
        rows = kwargs.pop(SP_KWARG, None)
        if rows is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        return rows.attend(query, key, value, dropout=kwargs.get("dropout", 0.0), scaling=kwargs.get("scaling"),
                           varlen=(original, module) if varlen else None)

    attention_or_ulysses._portarl_ulysses = True
    return attention_or_ulysses


def kv_repeat(kv_heads: int, size: int) -> int:
    """How many times each key / value head is repeated before the all-to-all (module docstring)."""
    return size // math.gcd(kv_heads, size)


def _config(model):
    get_base = getattr(model, "get_base_model", None)  # peft
    return getattr(get_base() if callable(get_base) else model, "config", None)


def sequence_parallel_refusal(cfg, model, world: int) -> str | None:
    """Why ``train.sequence_parallel_size`` cannot run with ``model`` on ``world`` ranks
    (one line naming the setting and the fix), or None."""
    size = cfg.train.sequence_parallel_size
    if size == 1:
        return None
    name = f"train.sequence_parallel_size={size}"
    if world == 1:
        return f"{name} needs torchrun with a multiple of {size} ranks (the sequence is cut across ranks); set it to 1"
    if world % size:
        return f"{name} must divide the {world} ranks (each group of {size} consecutive ranks shares its rows)"
    config = _config(model)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if not heads or heads % size:
        return (f"{name}: the model's num_attention_heads={heads} is not a multiple of it (each rank attends with "
                "heads / SP of them); choose a size that divides the head count")
    # GQA: kv_repeat(kv, SP) always divides the query heads per kv head when SP divides the
    # query heads (SP = d r with d = gcd(kv, SP) and r | (heads / kv) (kv / d), r coprime to kv / d).
    assert (heads // kv) % kv_repeat(kv, size) == 0
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa" and impl not in VARLEN_ATTENTION:
        return (f"{name}: model.attn_implementation={impl!r}: the all-to-all wraps sdpa and flash (varlen; "
                "npu_fusion_attention on Ascend) attention only (eager is the model file's own function, flex's "
                "block mask is per shard); set model.attn_implementation=sdpa")
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])) or \
            getattr(config, "use_sliding_window", False):
        return f"{name}: sliding-window attention layers are not supported; set it to 1"
    why = _unsupported(cfg, model)
    return None if why is None else f"{name} with {why}; set train.sequence_parallel_size=1"


def _unsupported(cfg, model) -> str | None:
    from portarl.moe.routing import is_moe
    from portarl.vision.models import is_vision_config

    if is_vision_config(_config(model)):
        return "a vision-language model: the vision tower's tokens are not cut across ranks"
    if is_moe(model):
        return "a mixture-of-experts model: routing replay and the expert-load counts are per whole row"
    if cfg.rollout.engine == "vllm":
        return "rollout.engine=vllm: the group's ranks must roll out the same rows (use rollout.engine=hf)"
    if cfg.rollout.mode == "async":
        return "rollout.mode=async: the worker's batches are split per rank, not per sequence-parallel group"
    if cfg.tools or cfg.environment:
        return "tools / an environment: multi-turn episodes are played per rank"
    from portarl.backends.emulation import resolve_profile

    if resolve_profile(cfg.precision.numerics):
        return f"precision.numerics={cfg.precision.numerics}: the NPU numerics emulation scores whole rows"
    return None


class _RowAttention:
    """One micro-batch's attention under SP: the group, the shard length every rank's
    query must have, and the whole rows' attention pattern: for sdpa their mask (bool
    [rows, 1, W, W], True = attend; None: plain causal), for varlen (flash) attention their
    spans (:func:`row_spans`). Counts its calls (one per decoder layer and forward)."""

    def __init__(self, sp: SPGroup, shard: int, mask: torch.Tensor | None, spans: tuple | None = None):
        self.sp, self.shard, self.mask, self.spans = sp, shard, mask, spans
        self.calls = 0

    def attend(self, query, key, value, *, dropout: float = 0.0, scaling: float | None = None, varlen=None):
        """transformers' attention contract: ``query`` [rows, heads, shard, d], ``key`` /
        ``value`` [rows, kv heads, shard, d] in, ([rows, shard, heads, d], None) out.
        ``varlen``: ``(flash attention function, module)``, called on the whole rows with
        their spans' cumulative lengths (transformers' padding-free kwargs), else sdpa."""
        if query.shape[2] != self.shard:
            raise RuntimeError(f"sequence parallel: attention got {query.shape[2]} tokens on this rank, not the "
                               f"shard's {self.shard}: the activations are not split")
        if varlen is None and self.spans is not None:  # built for varlen: sdpa would run plain causal
            raise RuntimeError("sequence parallel: the rows' spans were built for varlen attention, but sdpa was "
                               "called; the model's attn_implementation changed within the forward")
        self.calls += 1
        sp = self.sp
        repeat = kv_repeat(key.shape[1], sp.size)
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        query, key, value = (all_to_all(t, sp, scatter_dim=1, gather_dim=2) for t in (query, key, value))
        if varlen is not None:
            function, module = varlen
            if self.spans is None:
                raise RuntimeError("sequence parallel: varlen attention without the rows' spans")
            cu, longest, positions = self.spans
            out, _ = function(module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=True,
                              position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                              max_length_k=longest)  # [rows, W, heads / SP, d]
            return all_to_all(out, sp, scatter_dim=1, gather_dim=2).contiguous(), None
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=self.mask, dropout_p=dropout,
                                             is_causal=self.mask is None, scale=scaling)
        out = all_to_all(out, sp, scatter_dim=2, gather_dim=1)  # [rows, heads, shard, d]
        return out.transpose(1, 2).contiguous(), None


def _sequence_starts(positions: torch.Tensor) -> torch.Tensor:
    """bool [rows, W]: the columns that start a sequence: each row's first, and where a
    position id does not follow its left neighbour by 1 (transformers'
    ``find_packed_sequence_indices`` rule)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts


def row_spans(positions: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``(cu_seq_lens, longest, position_ids)`` of whole rows [rows, W] for varlen attention:
    int32 cumulative lengths over the flattened rows of spans that start at each row's first
    column, where a position does not follow its left neighbour by 1 (a new sequence, as in
    :func:`row_mask`), and where ``valid`` changes (padding is spans of its own, which no
    real token attends to); the longest span; the flattened position ids [1, rows x W].
    No [W, W] tensor: the kernel attends causally within each span."""
    rows, width = positions.shape
    starts = _sequence_starts(positions)
    if valid is not None:
        starts[:, 1:] |= valid[:, 1:] != valid[:, :-1]
    edges = torch.cat([starts.reshape(-1).nonzero().squeeze(1),
                       torch.tensor([rows * width], device=positions.device)])
    return edges.to(torch.int32), int((edges[1:] - edges[:-1]).max()), positions.reshape(1, -1)


def row_mask(positions: torch.Tensor, valid: torch.Tensor | None, explicit: torch.Tensor | None,
             real_width: int | None = None) -> torch.Tensor | None:
    """bool [rows, 1, W, W] (True = attend) of whole rows with ``positions`` [rows, W]:
    causal, within each sequence (a position that does not follow its left neighbour by 1
    starts one), keys with ``valid`` [rows, W] only; ``explicit`` [rows, 1, w, w] (a
    shared-prompt row's own mask, bool or additive) replaces that for its first w columns.
    Every query attends at least to itself (a padding query, whose output nothing reads,
    then stays finite). None when every row's first ``real_width`` columns (default all)
    are one sequence without padding: plain causal, since the columns after them (the
    padding to a multiple of SP) are keys to no earlier query and scored by nothing."""
    rows, width = positions.shape
    eye = torch.eye(width, dtype=torch.bool, device=positions.device)
    if explicit is not None:
        w = explicit.shape[-1]
        out = eye.expand(rows, 1, width, width).clone()
        out[..., :w, :w] = explicit if explicit.dtype == torch.bool else explicit == 0
        return out | eye
    starts = _sequence_starts(positions)
    real = width if real_width is None else real_width
    if not bool(starts[:, 1:real].any()) and (valid is None or bool(valid[:, :real].all())):
        return None
    seg = starts.cumsum(-1)
    keep = torch.ones(width, width, dtype=torch.bool, device=positions.device).tril() & (seg[:, :, None] == seg[:, None, :])
    if valid is not None:
        keep = keep & valid[:, None, :]
    return (keep | eye).unsqueeze(1)


def _whole_rows(batch):
    """``(input_ids, position_ids, valid, explicit)`` of the rows the forward runs, each
    [rows, W]: ``valid`` real keys (padded layout) or None; ``explicit`` a shared-prompt
    mask or None."""
    if batch.packed is None:
        return batch.input_ids, batch.position_ids, batch.attention_mask.bool(), None
    packed = batch.packed
    return packed.input_ids, packed.position_ids, None, packed.attention_mask


def _scored(batch, width: int, padded_width: int):
    """``(positions, labels)`` [K]: for each completion token the model scores, the flat
    index (into rows x ``padded_width``) of the position whose hidden state scores it, and
    the token: the labels shifted on the whole row, before it is cut. Padded rows: every
    cell of the completion grid [B, T] in order (label -100 on padding); padding-free:
    ``Packed.scored`` / ``where`` (shared-prompt rows score the first token of several
    completions from one position: one entry each)."""
    if batch.packed is None:
        rows, t = batch.labels.shape
        cols = torch.arange(batch.prompt_width - 1, batch.prompt_width - 1 + t, device=batch.labels.device)
        positions = (torch.arange(rows, device=cols.device)[:, None] * padded_width + cols[None, :]).reshape(-1)
        return positions, batch.labels.reshape(-1)
    scored = batch.packed.scored
    return (scored // width) * padded_width + scored % width, batch.labels.reshape(-1)[batch.packed.where]


def _pad(t: torch.Tensor, extra: int, fill) -> torch.Tensor:
    if not extra:
        return t
    return torch.cat([t, torch.full((t.shape[0], extra), fill, dtype=t.dtype, device=t.device)], dim=1)


def _to_grid(batch, values: torch.Tensor) -> torch.Tensor:
    """Per-entry values [K] of :func:`_scored` in the completion grid [B, T]."""
    if batch.packed is None:
        return values.view(batch.labels.shape)
    return to_grid(batch, values)


def _shard_forward(model, kwargs: dict):
    """``(hidden [rows, shard, H], weight, bias)`` of the model's forward on one shard."""
    if _is_sharded(model):  # FSDP2: the model's own forward gathers the parameters; no logits
        with _HeadPassthrough(model) as head:
            hidden = model(**kwargs, logits_to_keep=0).logits
        return hidden, head.weight, head.bias
    head = model.get_output_embeddings()
    return model.get_decoder()(**kwargs).last_hidden_state, head.weight, getattr(head, "bias", None)


def sp_completion_logprobs(model, batch, sp: SPGroup, *, temperature: float, logits_policy: str = "fp32",
                           with_entropy: bool = False):
    """:func:`portarl.trainer.phases.sequences.completion_logprobs` under sequence
    parallelism (module docstring): fp32 log-probs [B, T] (0 on padding), and entropy,
    equal on every rank of the group."""
    ids, positions, valid, explicit = _whole_rows(batch)
    rows, width = ids.shape
    padded_width = -(-width // sp.size) * sp.size
    extra = padded_width - width
    if extra:  # the padding is a sequence of its own, scored by nothing, a key to no real token
        tail = torch.arange(extra, device=positions.device).expand(rows, extra)
        positions = torch.cat([positions, tail], dim=1)
        ids = _pad(ids, extra, 0)
        valid = None if valid is None else _pad(valid, extra, False)
    shard = padded_width // sp.size
    config = _config(model)
    if getattr(config, "_attn_implementation", None) in VARLEN_ATTENTION:
        if explicit is not None:
            raise ValueError("sequence parallel: shared-prompt rows under varlen attention (their mask is not spans); "
                             "set train.share_prompt=false")
        attention = _RowAttention(sp, shard, None, row_spans(positions, valid))
    else:
        attention = _RowAttention(sp, shard, row_mask(positions, valid, explicit, width))
    cut = slice(sp.rank * shard, (sp.rank + 1) * shard)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    kwargs = {"input_ids": ids[:, cut], "position_ids": positions[:, cut], "use_cache": False,
              "attention_mask": {kind: None for kind in layer_types | {"full_attention"}}, SP_KWARG: attention}
    hidden, weight, bias = _shard_forward(model, kwargs)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    if hidden.shape[1] != shard:
        raise RuntimeError(f"sequence parallel: the hidden states hold {hidden.shape[1]} tokens, not the shard's "
                           f"{shard}: the activations are not split; set train.sequence_parallel_size=1")
    if attention.calls < max(1, layers):
        raise RuntimeError(f"sequence parallel: {attention.calls} of {layers} attention layers ran through the "
                           f"all-to-all: this model's attention ({type(model).__name__}) cannot be wrapped, its "
                           "shards would attend to themselves alone; set train.sequence_parallel_size=1")
    where, labels = _scored(batch, width, padded_width)
    column = where % padded_width - sp.rank * shard
    mine = ((column >= 0) & (column < shard) & (labels != -100)).nonzero().squeeze(1)  # the entries this shard scores
    empty = mine.numel() == 0  # none: score one position at weight 0, so that the final norm and the
    index = (where[mine] // padded_width) * shard + column[mine]  # head get (zero) gradients and FSDP2 reduces
    targets = labels[mine]  # the same tensors on every rank
    if empty:
        index = targets = torch.zeros(1, dtype=torch.long, device=where.device)
    chosen = hidden.reshape(-1, hidden.shape[-1])[index].unsqueeze(0)
    targets = targets.reshape(1, -1)
    fp32 = logits_policy == "fp32" or weight.dtype == torch.float32
    if fp32:
        if chosen.dtype != weight.dtype:
            chosen, weight = chosen.float(), weight.float()
            bias = None if bias is None else bias.float()
        if bias is not None and bias.dtype != weight.dtype:
            bias = bias.to(weight.dtype)
        out = ops.linear_logprobs(chosen, weight, targets, bias=bias, temperature=temperature,
                                  return_entropy=with_entropy)
    else:  # precision.logits=model with a low-precision head: logits rounded to its dtype first
        out = ops.logprobs(F.linear(chosen, weight, bias), targets, temperature=temperature,
                           return_entropy=with_entropy)
    values = out if with_entropy else (out,)

    def placed(v: torch.Tensor) -> torch.Tensor:
        v = v.reshape(-1)
        entries = torch.zeros(where.numel(), dtype=v.dtype, device=v.device)
        entries = entries + v.sum() * 0.0 if empty else entries.index_copy(0, mine, v)
        return _to_grid(batch, sum_over_group(entries, sp))  # every entry from the rank that scored it

    grids = tuple(placed(v) for v in values)
    return grids if with_entropy else grids[0]


__all__ = ["SP_KWARG", "install_attention", "kv_repeat", "row_mask", "row_spans", "sequence_parallel_refusal",
           "sp_completion_logprobs"]
