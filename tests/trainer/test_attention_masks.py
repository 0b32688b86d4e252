"""Attention masks of padding-free and shared-prompt rows under a bound
(portarl/trainer/phases/attention_masks.py): the flex BlockMask built from segment ids has
the tiles torch's own ``create_block_mask`` finds (document boundaries on and off a tile
boundary, shared-prompt units); flex with it gives the dense-mask (sdpa) log-probs within
the fp32 tolerance (bf16: its tolerance); over the bound sdpa rows hold no [T, T] buffer at
8k tokens (and the check sees one when the bound is lifted), still equal the padded
log-probs, stay within the token budget, and say why once; ``portarl plan`` counts the mask."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import portarl.trainer.phases.attention_masks as masks
import run_guard
from portarl.trainer.phases.micro_batches import micro_batches, pack
from portarl.trainer.phases.packing import layout_of
from portarl.trainer.phases.sequences import build_batch, completion_logprobs
from test_padding_free import VOCAB, _assert_packed_equal_padded, _batch, _fake_trainer, _model, _tolerance
from test_share_prompt import _groups_batch
from portarl.parity.errors import assert_close


# --- the BlockMask's tiles ---------------------------------------------------------------

def _torch_block_mask(seg, sub=None):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, kv):
        m = (seg[b, q] == seg[b, kv]) & (kv <= q)
        if sub is not None:
            m = m & ((sub[b, kv] == 0) | (sub[b, q] == sub[b, kv]))
        return m

    rows, width = seg.shape
    return create_block_mask(mask_mod, rows, None, width, width, device="cpu", _compile=False)


def _assert_same_tiles(got, want):
    for count, index in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                         ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        n = getattr(got, count)
        assert torch.equal(n.long(), getattr(want, count).long()), count
        a, b = getattr(got, index), getattr(want, index)
        for r, t in ((r, t) for r in range(n.shape[0]) for t in range(n.shape[2])):
            k = int(n[r, 0, t])
            assert a[r, 0, t, :k].tolist() == b[r, 0, t, :k].tolist(), (index, r, t)


def _segments(width, starts):
    seg = torch.zeros(width, dtype=torch.long)
    for s in starts:
        seg[s:] += 1
    return seg


@pytest.mark.parametrize("case", ["boundary-on-tile", "boundary-off-tile", "shared-prompt"])
def test_block_mask_tiles_equal_torch(case, monkeypatch):
    monkeypatch.setattr(masks, "_CHUNK_ELEMENTS", 2 * 128 * 128 * 2)  # chunks of 1 query tile x 2 key tiles
    if case == "boundary-on-tile":  # documents of 128 and 256 tokens: whole tiles are full
        seg = torch.stack([_segments(600, [128, 384]), _segments(600, [256, 512])])
        sub = None
    elif case == "boundary-off-tile":
        seg = torch.stack([_segments(600, [127, 300, 599]), _segments(600, [1, 129])])
        sub = None
    else:  # a unit: prompt 0..139, completions 140..199 / 200..383, then another unit from 384
        seg = torch.stack([_segments(600, [384]), _segments(600, [256])])
        sub = torch.zeros(2, 600, dtype=torch.long)
        sub[0, 140:200], sub[0, 200:384], sub[0, 450:600] = 1, 2, 1
        sub[1, 128:256], sub[1, 300:600] = 1, 1
    got = masks.block_mask(seg, sub)
    _assert_same_tiles(got, _torch_block_mask(seg, sub))
    assert got.shape == (2, 1, 600, 600)
    if case == "boundary-on-tile":
        assert int(got.full_kv_num_blocks.sum()) > 0, "no full tile: the full-tile path is not exercised"


# --- flex (BlockMask) equals the dense mask ------------------------------------------------

def _eager_flex(monkeypatch):
    """transformers compiles flex_attention (inductor's C++ template on CPU: a compile per
    shape, minutes on a loaded machine, and no backward on CPU in torch 2.13); the eager
    op computes the same attention from the BlockMask's mask_mod (the tiles are held to
    torch's own above)."""
    from torch.nn.attention.flex_attention import flex_attention
    import transformers.integrations.flex_attention as hf_flex

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda q, k, v, training=False, **kw: flex_attention(q, k, v, **kw))


def _long_batch(seed=0):
    """A sequence of exactly 128 tokens first (its row's next document starts on a tile
    boundary), then mixed lengths."""
    rng = random.Random(seed)
    shape = [(40, 88), (30, 70), (30, 50), (12, 20), (12, 9), (5, 0), (3, 1)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(p)] for p, _ in shape]
    completions = [[rng.randrange(3, VOCAB) for _ in range(c)] for _, c in shape]
    return build_batch(prompts, completions, 0, "cpu")


def _logprobs(model, part):
    with torch.no_grad():
        return completion_logprobs(model, part, temperature=0.9, with_entropy=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("share", [False, True], ids=["padding-free", "shared-prompt"])
def test_flex_block_mask_equals_dense_mask(monkeypatch, share, dtype):
    _eager_flex(monkeypatch)
    # A unit of exactly 128 tokens (prompt 101 + 3 x 9) first: the next starts on a tile boundary.
    batches = ((_groups_batch(groups=((101, (10, 10, 10)), (60, (8, 8, 8, 8)), (20, (5, 5, 1)))), _groups_batch())
               if share else (_long_batch(), _batch()))
    for batch in batches:
        dense_model, flex_model = _model(dtype, "sdpa"), _model(dtype, "flex_attention")
        flex_model.load_state_dict(dense_model.state_dict())
        dense = dataclasses.replace(layout_of(dense_model.config, "rows"), share_prompt=share)
        flex = dataclasses.replace(layout_of(flex_model.config, "rows"), share_prompt=share)
        (_, want_part), = micro_batches(_fake_trainer(dense), batch)
        (_, got_part), = micro_batches(_fake_trainer(flex), batch)
        from torch.nn.attention.flex_attention import BlockMask

        assert isinstance(got_part.packed.attention_mask, BlockMask)
        assert torch.equal(got_part.packed.input_ids, want_part.packed.input_ids)  # the same rows
        if share:
            assert want_part.packed.attention_mask is not None, "the shared layout was not used"
        want, got = _logprobs(dense_model, want_part), _logprobs(flex_model, got_part)
        tol = _tolerance(dense_model, batch, dtype)
        for name, w, g in zip(("logp", "entropy"), want, got):
            assert_close(g, w.double(), tol, f"{name} (flex block mask vs dense, share={share}, {dtype})")


def test_flex_block_mask_that_lets_sequences_meet_is_caught(monkeypatch):
    """The equality above is not vacuous: a BlockMask whose segments are merged (every
    token of a row one document) fails it."""
    _eager_flex(monkeypatch)
    real = masks.block_mask
    monkeypatch.setattr(masks, "block_mask", lambda seg, sub=None: real(torch.zeros_like(seg), sub))
    model = _model(torch.float32, "flex_attention")
    dense = _model(torch.float32, "sdpa")
    batch = _long_batch()
    (_, want_part), = micro_batches(_fake_trainer(layout_of(dense.config, "rows")), batch)
    (_, got_part), = micro_batches(_fake_trainer(layout_of(model.config, "rows")), batch)
    with pytest.raises(AssertionError, match="logp"):
        w, g = _logprobs(dense, want_part)[0], _logprobs(model, got_part)[0]
        assert_close(g, w.double(), _tolerance(dense, batch, torch.float32), "logp")


# --- over the bound: no [T, T] buffer ------------------------------------------------------

class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op returns (the mask transformers builds, the
    attention's outputs, everything)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_in_forward(tokens):
    """Largest tensor of the scoring forward of a micro-batch holding a ``tokens``-token
    sequence and a short one (padding-free rows of the longest: 2 rows x ``tokens``)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(16)], [5, 6, 7]]
    completions = [[rng.randrange(3, VOCAB) for _ in range(tokens - 16)], [8, 9]]
    batch = build_batch(prompts, completions, 0, "cpu")
    model = tiny_model()
    (_, part), = micro_batches(_fake_trainer(layout_of(model.config, "rows")), batch)
    with torch.no_grad(), _Largest() as spy:
        completion_logprobs(model, part, temperature=1.0)
    return spy.largest, part


def tiny_model():
    from portarl.assets.models import tiny_qwen2

    model = tiny_qwen2(VOCAB, hidden_size=32, layers=1, seed=0)
    model.config._attn_implementation = "sdpa"
    return model


def test_no_tokens_by_tokens_buffer_at_8k(monkeypatch):
    t = 8192
    largest, part = _largest_in_forward(t)
    assert part.packed.input_ids.shape == (2, t)
    assert largest < t * t // 16, f"a tensor of {largest} elements (T x T = {t * t}) in the forward"
    # The check sees the dense mask when the bound does not stop it.
    monkeypatch.setattr(masks, "DENSE_MASK_BOUND_BYTES", 1 << 40)
    largest, _ = _largest_in_forward(t)
    assert largest >= t * t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_causal_rows_equal_padded(monkeypatch, dtype):
    """Every micro-batch over a (lowered) bound: one sequence per row, no mask; shared-prompt
    rows are not shared then. Log-probs and entropy equal the padded path's."""
    monkeypatch.setattr(masks, "DENSE_MASK_BOUND_BYTES", 0)
    from test_share_prompt import _shared

    _assert_packed_equal_padded(_model(dtype), _batch(), "rows", dtype)
    _assert_packed_equal_padded(_model(dtype), _groups_batch(), _shared("rows"), dtype)
    part = micro_batches(_fake_trainer(layout_of(_model().config, "rows")), _batch())[0][1]
    from transformers.masking_utils import find_packed_sequence_indices

    assert part.packed.attention_mask is None and find_packed_sequence_indices(part.packed.position_ids) is None
    assert part.packed.input_ids.shape[0] == _batch().labels.shape[0]  # one row per sequence


def test_fallback_logs_its_reason_once(monkeypatch, caplog):
    monkeypatch.setattr(masks, "DENSE_MASK_BOUND_BYTES", 0)
    monkeypatch.setattr(masks, "_logged", set())
    from test_share_prompt import _shared

    with caplog.at_level(logging.INFO, logger="portarl.train"):
        for _ in range(2):
            micro_batches(_fake_trainer(_shared("rows")), _groups_batch())
        micro_batches(_fake_trainer(layout_of(_model(impl="eager").config, "rows")), _batch())
    lines = [r.getMessage() for r in caplog.records]
    assert sum("one sequence per row, causal attention without a mask" in m for m in lines) == 1, lines
    assert sum("shared-prompt rows: not shared" in m and "bound" in m for m in lines) == 1, lines
    assert sum("eager attention holds" in m and "model.attn_implementation=sdpa" in m for m in lines) == 1, lines


def test_budget_counts_causal_rows():
    """Rows that fall back to one sequence each compute rows x the longest: the token
    budget cuts micro-batches by that, not by the packed rows."""
    lengths = [1000] + [50] * 30
    parts = pack([1] * 31, [n - 1 for n in lengths], 64, 4000, layout="rows", causal=lambda rows, width: True)
    for part in parts:
        assert len(part) * max(lengths[i] for i in part) <= 4000 or len(part) == 1
    packed = pack([1] * 31, [n - 1 for n in lengths], 64, 4000, layout="rows")
    assert len(packed) < len(parts)


def test_plan_counts_the_mask():
    """32k-token sequences: padded sdpa counts transformers' dense mask and SDPA's additive
    copy per layer; padding-free sdpa at most the bound's pairs; flash nothing; flex a block
    mask; and the update phase includes it."""
    from portarl.trainer.config import TrainConfig
    from portarl.trainer.memory.arch import arch_of
    from portarl.trainer.memory.plan import estimate

    cfg = TrainConfig()
    cfg.rollout.max_new_tokens = 32768
    cfg.train.max_tokens_per_micro_batch = 65536
    cfg.train.gradient_checkpointing = False
    arch = arch_of(cfg.model)
    b, layers = 4, arch.layers
    got = {}
    for impl, padding_free in (("sdpa", True), ("flash_attention_2", True), ("sdpa", False), ("flex_attention", True)):
        cfg.model.attn_implementation, cfg.train.padding_free = impl, padding_free
        plan = estimate(cfg, arch, prompt_tokens=100)
        got[impl, padding_free] = mask = plan.parts["attention mask"]
        assert mask <= plan.update
        if (impl, padding_free) == ("sdpa", False):
            assert mask == plan.micro_batch_rows * plan.sequence_tokens ** 2 * (1 + b * layers)
        if impl == "flex_attention":
            assert mask == (-(-plan.micro_batch_tokens // 128)) ** 2 * 16
    pairs = masks.DENSE_MASK_BOUND_BYTES // masks.SDPA_MASK_PAIR_BYTES
    assert got["sdpa", True] == pairs * (1 + b * layers)
    assert got["flash_attention_2", True] == 0
    assert got["sdpa", False] > got["sdpa", True] > got["flex_attention", True] > 0


def test_row_chooser_counts_the_mask(monkeypatch):
    """A model whose linear maps dominate packs one long row; with that row's mask over the
    bound the chooser keeps rows within it (here: rows of the longest sequence)."""
    from portarl.trainer.phases.pack_rows import choose_rows
    from portarl.trainer.phases.packing import Layout

    lengths = [10, 9, 3, 3, 2, 1]  # as in test_pack_rows: rows of the longest are 3 x 10
    layout = Layout("rows", linear=1000, attention=1, impl="sdpa")
    assert choose_rows(lengths, layout) == [[0, 1, 2, 3, 4, 5]]
    monkeypatch.setattr(masks, "DENSE_MASK_BOUND_BYTES", 3 * 10 * 10 * masks.SDPA_MASK_PAIR_BYTES)
    rows = choose_rows(lengths, layout)
    width = max(sum(lengths[i] for i in r) for r in rows)
    assert len(rows) > 1 and masks.fits(len(rows), width, layout)


@pytest.mark.compares_runs
@pytest.mark.parametrize("setting", [[], ["train.max_tokens_per_micro_batch=30"]], ids=["plain", "budget"])
def test_causal_rows_step_gradients_equal_padded(tmp_path, monkeypatch, setting):
    """A whole GRPO step (scoring, update) whose every micro-batch is over a (lowered)
    bound: its gradients equal the padded step's, and every forward ran causal rows."""
    import portarl.trainer.phases.micro_batches as mb
    from test_memory_checkpointing import _assert_same, _gradients
    from transformers.masking_utils import find_packed_sequence_indices

    padded, _ = _gradients(tmp_path, monkeypatch, "train.padding_free=false", *setting, name="padded")
    monkeypatch.setattr(masks, "DENSE_MASK_BOUND_BYTES", 0)
    seen = []
    real = mb.pack_micro_batch

    def spy(*args):
        out = real(*args)
        seen.append(out.attention_mask is None and find_packed_sequence_indices(out.position_ids) is None)
        return out

    monkeypatch.setattr(mb, "pack_micro_batch", spy)
    causal, trainer = _gradients(tmp_path, monkeypatch, "train.padding_free=true", *setting, name="causal")
    assert trainer.padding_free.kind == "rows" and seen and all(seen)
    run_guard.assert_gradient_flows(padded, what=f"the padded step's gradients ({setting})")
    run_guard.assert_gradient_flows(causal, what=f"the causal-rows step's gradients ({setting})")
    _assert_same(padded, causal)


def test_flex_attention_that_cannot_train_here_is_refused_at_start():
    """torch 2.13 has no FlexAttention backward on CPU: the trainer's layout resolution
    refuses it in one line naming the setting (sdpa is not refused)."""
    from portarl.trainer.config.fields import ConfigError
    from portarl.trainer.phases.packing import resolve_padding_free
    from test_share_prompt import _cfg

    with pytest.raises(ConfigError, match="model.attn_implementation=flex_attention.*set model.attn_implementation=sdpa"):
        resolve_padding_free(_cfg(), _model(impl="flex_attention"))
    assert resolve_padding_free(_cfg(), _model()).kind == "rows"


def test_block_mask_refuses_a_segment_split_in_two_runs():
    seg = torch.tensor([[0, 0, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="contiguous"):
        masks.block_mask(seg)


def test_flex_attention_on_a_device_torch_does_not_support_is_refused(monkeypatch):
    """Ascend NPUs: torch's FlexAttention raises ValueError for their device type (only
    CUDA, CPU, XPU, HPU, MPS); stood in here by that ValueError from the probe."""
    import torch.nn.attention.flex_attention as flex
    from portarl.trainer.config.fields import ConfigError

    def unsupported(*args, **kwargs):
        raise ValueError("FlexAttention is only supported on CUDA, CPU, HPU, or MPS devices. Found npu")

    monkeypatch.setattr(flex, "flex_attention", unsupported)
    with pytest.raises(ConfigError, match="flex_attention: .*only supported on CUDA"):
        masks.refuse_untrainable_flex(_model(impl="flex_attention"))
    masks.refuse_untrainable_flex(_model())  # other attention: nothing probed
