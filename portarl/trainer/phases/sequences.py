"""Token batches for the trainer and the model forward that gives per-token log-probs.

A batch is laid out exactly as the rollout engine saw it: prompts left-padded to a common
width P, completions after them (right-padded), position ids from the attention mask. The
log-prob of completion token j comes from the hidden state at position P - 1 + j; those T
positions and the lm head go to :func:`portarl.ops.linear_logprobs`, which scores them with
fp32 accumulation without ever building the full-vocabulary logits.

A micro-batch may carry a padding-free layout (``TokenBatch.packed``,
:mod:`portarl.trainer.phases.packing`): its forward then runs on the sequences back to back, and
only the positions that score a completion token reach the lm head; the log-probs come
back in the same [B, T] completion grid.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F

from portarl import ops
from portarl.backends.rows import chunk_rows
from portarl.backends.emulation import bf16_valued, entropy_in_logits_dtype, matmul_context
from portarl.trainer.phases.packing import Packed, scored_hidden, scored_labels, to_grid


@dataclasses.dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T]
    position_ids: torch.Tensor  # [B, P + T]
    labels: torch.Tensor  # [B, T] completion tokens, -100 on padding
    mask: torch.Tensor  # [B, T] bool
    prompt_width: int
    packed: Packed | None = None  # the padding-free forward of these rows (portarl.trainer.phases.packing)
    #: A vision-language model's inputs for these rows (pixels, M-RoPE positions:
    #: :class:`portarl.vision.inputs.VisionRows`), else None.
    vision: object = None
    #: A mixture-of-experts model with routing replay: the experts the rollout engine chose
    #: per token (:class:`portarl.moe.routing.RoutingRows`), else None.
    routing: object = None

    def rows(self, index: slice) -> "TokenBatch":
        """These rows, padded (a packed layout belongs to the rows it was built for)."""
        return TokenBatch(self.input_ids[index], self.attention_mask[index], self.position_ids[index],
                          self.labels[index], self.mask[index], self.prompt_width,
                          vision=None if self.vision is None else self.vision.rows(index),
                          routing=None if self.routing is None else self.routing.rows(index))


def padded(rows: list[list], width: int, fill, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` (lists of numbers) right-padded with ``fill`` to ``width`` as one
    [len(rows), width] tensor, built with a single ``torch.tensor`` call: a per-row tensor
    and slice assignment costs tens of microseconds each, which added up to tens of ms per
    step at 64 rows."""
    return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=dtype)


def build_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device,
                model_mask: list[list[bool]] | None = None, vision=None, routing: list | None = None) -> TokenBatch:
    """The batch tensors, each built from padded lists in one call (:func:`padded`), not
    one small tensor per row: this runs every step on the host. ``model_mask`` (multi-turn
    episodes): per completion token, whether the model produced it; ``mask`` then covers
    those tokens only (tool and environment tokens are in the sequence, read as context,
    and out of the loss, the mismatch correction and the guards). ``vision`` (a
    vision-language model): a :class:`portarl.vision.inputs.VisionBatch` of the rows.
    ``routing`` (routing replay): each row's recorded experts (``RolloutBatch.routed_experts``)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    width_p = max(len(p) for p in prompts)
    width_c = max(1, max(len(c) for c in completions))
    rows = [[pad_id] * (width_p - len(p)) + list(p) + list(c) for p, c in zip(prompts, completions)]
    ids = padded(rows, width_p + width_c, pad_id, torch.long)
    attn = padded([[0] * (width_p - len(p)) + [1] * (len(p) + len(c)) for p, c in zip(prompts, completions)],
                  width_p + width_c, 0, torch.long)
    labels = padded(completions, width_c, -100, torch.long)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    mask = labels != -100
    if model_mask is not None:
        mask &= padded(model_mask, width_c, False, torch.bool)
    rows_vision = None if vision is None else vision.rows([len(p) for p in prompts], [len(c) for c in completions],
                                                          width_p, width_c, device)
    rows_routing = None
    if routing is not None:
        from portarl.moe.routing import routing_rows

        rows_routing = routing_rows(routing, [len(p) for p in prompts], [len(c) for c in completions], width_p,
                                    width_c, device)
    return TokenBatch(ids.to(device), attn.to(device), positions.to(device), labels.to(device), mask.to(device), width_p,
                      vision=rows_vision, routing=rows_routing)


def _is_sharded(model) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    from portarl.assets.lora import base_model

    return isinstance(base_model(model), FSDPModule)  # a peft model: FSDP2 shards the model inside it


#: Set to 1 to score through full-vocabulary logits (the pre-fused path; for A/B measurements).
MATERIALIZE_ENV = "PORTARL_MATERIALIZE_LOGITS"


def _materialize() -> bool:
    return os.environ.get(MATERIALIZE_ENV, "0") == "1"


class _HeadPassthrough:
    """Inside the model's own forward, make the output embedding return its input (the
    hidden states) and remember its parameters as the forward sees them: under FSDP2 that
    is the root's all-gathered (unsharded) weight, kept through backward (the root does not
    reshard after forward), so gradients reach FSDP's reduce-scatter as usual.

    The hidden states go back as a copy, not as they arrive: transformers slices them before
    its head (``hidden_states[:, slice_indices, :]``, ``logits_to_keep``), so they arrive as
    a view of the decoder's output, and the root module's output would be that view. FSDP2
    warns about a view output once per rank ("returned a view tensor ... will silently drop
    the pre-backward hook and skip the all-gather"): an in-place op on the view would skip
    the all-gather before backward. The copy is a tensor of its own (no view whose hook an
    in-place op could drop), holds only the kept positions, and lets the decoder's whole
    output be freed after the forward instead of living, through the view, until backward;
    its values are the same bits (tests/distributed/test_console.py)."""

    def __init__(self, model):
        self.head = model.get_output_embeddings()
        self.weight = self.bias = None

    def __enter__(self):
        head = self

        def forward(hidden):
            head.weight = head.head.weight
            head.bias = getattr(head.head, "bias", None)
            return hidden.clone()  # not a view of the decoder's output: the class docstring

        self.head.forward = forward
        return self

    def __exit__(self, *exc):
        del self.head.forward  # back to the class's forward
        return False


def _forward_kwargs(batch: TokenBatch) -> dict:
    if batch.packed is not None:
        kwargs = batch.packed.forward_kwargs()
        if batch.vision is not None:
            kwargs.update(batch.vision.packed_kwargs(batch.packed, batch.input_ids.shape[1]))
        return kwargs
    kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "position_ids": batch.position_ids}
    if batch.vision is not None:
        kwargs.update(batch.vision.padded_kwargs(batch.input_ids))
    return kwargs


def _route(model, batch: TokenBatch) -> None:
    """Routing replay: the recorded experts of ``batch`` for the next forwards of ``model``
    (:func:`portarl.moe.routing.set_replay`), or the routers' own choice when it has none."""
    if batch.routing is not None:
        from portarl.moe.routing import set_replay

        set_replay(model, *batch.routing.flat(batch.packed))
    elif getattr(model, "_portarl_replays", False):
        from portarl.moe.routing import set_replay

        set_replay(model, None)


def hidden_states(model, batch: TokenBatch) -> torch.Tensor:
    """The decoder's last hidden states of ``batch``'s forward. A vision-language model
    runs its ``model.model`` (vision tower, image features into the placeholders, the
    language model with M-RoPE positions); a text model its decoder."""
    _route(model, batch)
    if batch.vision is not None:
        from portarl.assets.lora import base_model

        return base_model(model).model(**_forward_kwargs(batch)).last_hidden_state
    return model.get_decoder()(**_forward_kwargs(batch)).last_hidden_state


class _VisionGradsEverywhere:
    """A vision-language micro-batch without images, under FSDP2: its forward never runs
    the vision tower, so the tower's trainable parameters (the projector; all of it with
    ``model.freeze_vision: false``) get no gradient on this rank, while a rank whose
    micro-batch has images gets one. FSDP2 reduce-scatters only the gradients that exist,
    so the ranks' collectives would differ in size (Gloo aborts: "Received data size
    doesn't match expected size"; NCCL would hang or mix buffers). Inside the forward this
    adds ``0 * sum(p)`` of those parameters, as FSDP2 has gathered them, to the input
    embeddings: every rank then has their gradients (zeros here) and the values are
    unchanged (``x + 0.0 == x``)."""

    def __init__(self, model):
        from portarl.vision.models import vision_parts

        self.tower, _ = vision_parts(model)
        self.embed = model.get_input_embeddings()
        self.handle = None

    def __enter__(self):
        def add_zero(module, args, output):
            params = [p for p in self.tower.parameters() if p.requires_grad]  # the unsharded ones, in the forward
            return output + sum(p.sum() for p in params) * 0.0 if params else output

        self.handle = self.embed.register_forward_hook(add_zero)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        return False


def _sharded_forward(model, batch: TokenBatch):
    """The FSDP2 model's own forward; its output's ``logits`` at the scoring positions
    (padded: the last T + 1 positions, ``logits_to_keep``; packed: every position). A
    vision-language micro-batch passes its pixels and M-RoPE positions (``_forward_kwargs``);
    one without images still gives the tower's trainable parameters a gradient
    (:class:`_VisionGradsEverywhere`)."""
    keep = 0 if batch.packed is not None else batch.labels.shape[1] + 1
    _route(model, batch)
    kwargs = _forward_kwargs(batch)
    if batch.vision is not None and "pixel_values" not in kwargs and torch.is_grad_enabled():
        with _VisionGradsEverywhere(model):
            logits = model(**kwargs, logits_to_keep=keep).logits
    else:
        logits = model(**kwargs, logits_to_keep=keep).logits
    return scored_hidden(batch, logits) if batch.packed is not None else logits[:, :-1]


def completion_hidden(model, batch: TokenBatch):
    """``(hidden, weight [V, H], bias [V] or None)``: the decoder's last hidden states at
    the positions that score completion tokens (padded [B, T, H]; packed [1, K, H], see
    :func:`portarl.trainer.phases.packing.scored_labels`) and the output embedding (tied or not)
    that scores them.

    Under FSDP2 the model's own forward runs (it gathers the sharded parameters) with the
    head passed through (:class:`_HeadPassthrough`), so no logits exist even there.
    """
    if _is_sharded(model):
        with _HeadPassthrough(model) as head:
            hidden = _sharded_forward(model, batch)
        return hidden, head.weight, head.bias
    hidden = hidden_states(model, batch)
    head = model.get_output_embeddings()
    return scored_hidden(batch, hidden), head.weight, getattr(head, "bias", None)


def completion_logits(model, batch: TokenBatch, logits_policy: str = "fp32") -> torch.Tensor:
    """Full-vocabulary logits for the completion positions ([B, T, V], or packed [1, K, V]):
    only for the NPU emulation profile, ``precision.logits="model"`` with a low-precision
    model, and the ``PORTARL_MATERIALIZE_LOGITS=1`` A/B switch; the trainer otherwise never
    builds them.

    Under FSDP2 the model's own forward computes the head (padded: on the last T + 1
    positions, ``logits_to_keep``), in the parameters' compute dtype.
    """
    if _is_sharded(model):
        return _sharded_forward(model, batch)
    h = scored_hidden(batch, hidden_states(model, batch))
    head = model.get_output_embeddings()
    if logits_policy == "fp32":
        bias = head.bias.float() if getattr(head, "bias", None) is not None else None
        return F.linear(h.float(), head.weight.float(), bias)
    return head(h)


def nonfinite_logit_positions(model, batch: TokenBatch, logits_policy: str = "fp32") -> torch.Tensor:
    """bool [B, T]: completion positions whose logits hold a NaN or inf, checked in row
    chunks of at most ``PORTARL_CHUNK_ELEMENTS`` logits (never all N x V at once)."""
    with torch.no_grad():
        hidden, weight, bias = completion_hidden(model, batch)
        fp32 = logits_policy == "fp32"
        w = weight.float() if fp32 else weight
        b = None if bias is None else (bias.float() if fp32 else bias)
        flat = hidden.reshape(-1, hidden.shape[-1])
        bad = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
        step = chunk_rows(weight.shape[0])
        for r0 in range(0, flat.shape[0], step):
            rows = flat[r0 : r0 + step]
            z = F.linear(rows.float() if fp32 else rows.to(w.dtype), w, b)
            bad[r0 : r0 + step] = ~torch.isfinite(z).all(dim=-1)
    return to_grid(batch, bad.view(hidden.shape[:-1]), False) & batch.mask


def _fused_ok(model, logits_policy: str, emulate: frozenset) -> bool:
    if emulate or _materialize():
        return False
    if logits_policy == "model":
        head = model.get_output_embeddings()
        return head.weight.dtype == torch.float32  # "model" on an fp32 head is the fp32 path
    return True


def completion_logprobs(model, batch: TokenBatch, *, temperature: float, logits_policy: str = "fp32",
                        with_entropy: bool = False, emulate: frozenset = frozenset()):
    """fp32 log-probs [B, T] (0 on padding) and optionally entropy, through portarl.ops.

    Default path: :func:`portarl.ops.linear_logprobs` from the decoder's hidden states and
    the output embedding (tied or not), so no full-vocabulary logits exist in the step;
    ``logits_policy="fp32"``: logits accumulated and kept in fp32 inside the op. With
    ``logits_policy="model"`` and a low-precision head (logits rounded to the compute dtype
    first, the HF numbers), with ``emulate`` switches of :mod:`portarl.backends.emulation` (the NPU
    numerics emulation) or with ``PORTARL_MATERIALIZE_LOGITS=1``, the logits are built
    (:func:`completion_logits`) and scored by :func:`portarl.ops.logprobs`.
    """
    if _fused_ok(model, logits_policy, emulate):
        hidden, weight, bias = completion_hidden(model, batch)
        if hidden.dtype != weight.dtype:
            hidden, weight = hidden.float(), weight.float()
            bias = None if bias is None else bias.float()
        if bias is not None and bias.dtype != weight.dtype:
            bias = bias.to(weight.dtype)
        out = ops.linear_logprobs(hidden, weight, scored_labels(batch), bias=bias, temperature=temperature,
                                  return_entropy=with_entropy)
        return tuple(to_grid(batch, v) for v in out) if with_entropy else to_grid(batch, out)
    with matmul_context(emulate):
        policy = "model" if "bf16_logprobs" in emulate else logits_policy
        logits = completion_logits(model, batch, policy)
    no_upcast = with_entropy and "entropy_no_upcast" in emulate
    out = ops.logprobs(logits, scored_labels(batch), temperature=temperature,
                       return_entropy=with_entropy and not no_upcast)
    logp, entropy = (out if with_entropy and not no_upcast else (out, None))
    if "bf16_logprobs" in emulate and logits.dtype == torch.bfloat16:
        logp = bf16_valued(logp)
    if no_upcast:
        entropy = torch.where(batch.mask, to_grid(batch, entropy_in_logits_dtype(logits, temperature)), 0.0)
    elif entropy is not None:
        entropy = to_grid(batch, entropy)
    logp = to_grid(batch, logp)
    return (logp, entropy) if with_entropy else logp
