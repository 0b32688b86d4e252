"""Padding-free micro-batches (``train.padding_free``, portarl/trainer/phases/packing.py): the
packed layout restarts position ids per sequence and keeps sequences apart; log-probs,
entropy and gradients equal the padded path's within the fp32 tolerance (bf16: two
roundings apart), including sequences that end exactly at a row's end, single-token and
empty completions and mixed lengths; the test catches a mask that lets tokens attend across
sequences; the varlen layout hands a varlen kernel the cumulative lengths transformers
would derive; models without support fall back (auto) or are refused (true)."""

from __future__ import annotations

import dataclasses
import logging
import random
import types

import pytest
import torch

import portarl.trainer.phases.packing as packing
import run_guard
from portarl.assets.models import tiny_qwen2
from portarl.parity.errors import assert_close
from portarl.parity.tolerances import fp32_result, low_precision_forward
from portarl.trainer.phases.micro_batches import micro_batches
from portarl.trainer.phases.packing import Layout, layout_of
from portarl.trainer.phases.sequences import MATERIALIZE_ENV, build_batch, completion_logits, completion_logprobs
from test_memory_checkpointing import _assert_same, _gradients
from varlen_standin import varlen_standin

VOCAB = 100


def _fake_trainer(kind, budget=None, rows=64):
    train = types.SimpleNamespace(micro_batch_size=rows, max_tokens_per_micro_batch=budget)
    return types.SimpleNamespace(config=types.SimpleNamespace(train=train), dist=types.SimpleNamespace(enabled=False),
                                 padding_free=kind)


def _batch(seed=0):
    """Mixed lengths with the edge cases: single-token and empty completions, and lengths
    (prompt + completion) 12, 6, 6, 4, 4, 4 ... so that the rows of the "longest" layout
    (capacity: the longest, 12) are filled exactly by two 6s or three 4s."""
    rng = random.Random(seed)
    shape = [(5, 7), (2, 4), (3, 3), (1, 3), (3, 1), (2, 2), (4, 0), (1, 1), (6, 5), (2, 9)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(p)] for p, _ in shape]
    completions = [[rng.randrange(3, VOCAB) for _ in range(c)] for _, c in shape]
    return build_batch(prompts, completions, 0, "cpu")


def _model(dtype=torch.float32, impl="sdpa", seed=2):
    model = tiny_qwen2(VOCAB, hidden_size=64, layers=3, seed=seed).to(dtype)
    model.config._attn_implementation = impl
    return model


#: "rows": the test model's own costs (its rows hold several sequences); "longest": rows
#: no longer than the longest sequence (tails, several rows); "varlen": one row.
LAYOUTS = {"rows": layout_of(_model().config, "rows"), "longest": Layout("rows", longest_only=True),
           "varlen": Layout("varlen")}


def _one_part(kind, batch, **kw):
    """The one micro-batch of ``batch``: padded (``kind`` None), or packed in ``LAYOUTS[kind]``
    or in ``kind`` (a :class:`Layout`)."""
    layout = LAYOUTS[kind] if isinstance(kind, str) else kind
    (rows, part), = micro_batches(_fake_trainer(layout, **kw), batch)
    return part


def _tolerance(model, batch, dtype):
    with torch.no_grad():
        scale = float(completion_logits(model, batch).abs().max())  # max |z|, as parity.tolerances defines it
    return fp32_result(scale) if dtype == torch.float32 else low_precision_forward(scale, dtype)


def _assert_packed_equal_padded(model, batch, kind, dtype=torch.float32, **kw):
    padded, packed = _one_part(None, batch, **kw), _one_part(kind, batch, **kw)
    assert padded.packed is None and packed.packed is not None
    with torch.no_grad():
        want = completion_logprobs(model, padded, temperature=0.9, with_entropy=True)
        got = completion_logprobs(model, packed, temperature=0.9, with_entropy=True)
    tol = _tolerance(model, batch, dtype)
    for name, w, g in zip(("logp", "entropy"), want, got):
        assert g.shape == w.shape == batch.labels.shape
        assert bool((g[~batch.mask] == 0).all()), f"{name}: non-zero where there is no completion token"
        assert_close(g, w.double(), tol, f"{name} ({kind}, {dtype})")


def test_layout_restarts_positions_and_transformers_sees_each_sequence_alone():
    from transformers.masking_utils import find_packed_sequence_indices

    batch = _batch()
    lengths = (batch.attention_mask.sum(-1)).tolist()
    for kind in LAYOUTS:
        p = _one_part(kind, batch).packed
        ids, pos = p.input_ids, p.position_ids
        if kind == "varlen":
            assert ids.shape == (1, sum(lengths)) and p.max_length == max(lengths)
            assert p.cu_seq_lens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
        else:
            assert p.cu_seq_lens is None and ids.numel() <= len(lengths) * max(lengths)
            filled = [r for r in range(ids.shape[0]) if int(pos[r, -1]) != 0 and (pos[r] == 0).sum() > 1]
            assert filled, "no row filled to its end by more than one sequence (the boundary case)"
        if kind == "longest":
            assert ids.shape[1] == max(lengths) and ids.shape[0] > 1 and (pos[:, -1] == 0).any()  # rows with tails
        segments = find_packed_sequence_indices(pos)
        seen = []
        for r in range(ids.shape[0]):
            for s in segments[r].unique():
                span = (segments[r] == s).nonzero().flatten()
                assert pos[r, span].tolist() == list(range(len(span)))  # restarts at 0, no gap
                seen.append(ids[r, span].tolist())
        real = [batch.input_ids[i][batch.attention_mask[i].bool()].tolist() for i in range(len(lengths))]
        for seq in real:  # every sequence is one segment of its own, token for token
            assert seq in seen
        # The scored positions are followed by exactly their labels.
        flat_ids = ids.reshape(-1)
        labels = batch.labels.reshape(-1)[p.where]
        assert torch.equal(flat_ids[p.scored + 1], labels) and bool((labels != -100).all())
        assert p.where.numel() == int((batch.labels != -100).sum()) == int(batch.attention_mask[:, batch.prompt_width:].sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_packed_logprobs_and_entropy_equal_padded(dtype, impl, kind):
    """``varlen`` here is the one-row layout through the same mask-based attention (the
    flash kernels themselves do not run on CPU: see the stand-in test below)."""
    for seed in (0, 1):
        _assert_packed_equal_padded(_model(dtype, impl, seed=seed), _batch(seed), kind, dtype)


def test_flex_attention_packs_too():
    """flex_attention builds its block mask from the same restarting positions. transformers
    runs it through torch.compile (inductor's C++ flex template on CPU), whose code for
    some recompiled shapes does not build in torch 2.13: one layout and a fresh compile
    cache keep this test on the shapes it compiles (the layouts are covered above)."""
    torch._dynamo.reset()
    try:
        _assert_packed_equal_padded(_model(impl="flex_attention"), _batch(), "rows")
    finally:
        torch._dynamo.reset()


def test_tokens_a_completion_does_not_score_stay_in_the_sequence():
    """A completion token with label -100 (not the model's: a tool's output in a
    multi-turn sample) and outside the loss mask is still part of its sequence: the tokens
    after it see it, packed as padded, and it scores 0."""
    batch = _batch()
    labels, mask = batch.labels.clone(), batch.mask.clone()
    labels[0, 2:4] = -100  # row 0: 7 completion tokens, two in the middle not scored
    mask[0, 2:4] = False
    batch = dataclasses.replace(batch, labels=labels, mask=mask)
    for kind in LAYOUTS:
        part = _one_part(kind, batch)
        assert part.labels.shape[1] == 9  # still the widest completion
        _assert_packed_equal_padded(_model(), batch, kind)


def test_materialised_logits_and_npu_emulation_paths_equal_padded(monkeypatch):
    from portarl.backends.emulation import resolve_profile

    batch = _batch()
    monkeypatch.setenv(MATERIALIZE_ENV, "1")
    _assert_packed_equal_padded(_model(), batch, "rows")
    monkeypatch.setenv(MATERIALIZE_ENV, "0")
    model = _model(torch.bfloat16)
    emulate = resolve_profile("npu-emulated")
    out = []
    for kind in (None, "rows"):
        with torch.no_grad():
            out.append(completion_logprobs(model, _one_part(kind, batch), temperature=1.0, with_entropy=True,
                                           emulate=emulate))
    tol = _tolerance(model, batch, torch.bfloat16)
    for name, w, g in zip(("logp", "entropy"), *out):
        assert_close(g, w.double(), tol, f"npu-emulated {name}")


def _drop_use_cache(monkeypatch):  # transformers then makes a KV cache and builds no packed mask
    real = packing.Packed.forward_kwargs
    monkeypatch.setattr(packing.Packed, "forward_kwargs",
                        lambda self: {k: v for k, v in real(self).items() if k != "use_cache"})


def _positions_never_restart(monkeypatch):  # one long sequence per row: no segments at all
    real = packing.Packed.forward_kwargs

    def leaky(self):
        kwargs = real(self)
        n = kwargs["position_ids"].shape[1]
        kwargs["position_ids"] = torch.arange(n).expand_as(kwargs["position_ids"])
        return kwargs

    monkeypatch.setattr(packing.Packed, "forward_kwargs", leaky)


def _mask_ignores_segments(monkeypatch):  # right positions (RoPE), but a plain causal mask
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda position_ids: None)


@pytest.mark.parametrize("fault", [_drop_use_cache, _positions_never_restart, _mask_ignores_segments])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_across_sequences_is_caught(monkeypatch, fault, dtype):
    """The equality check is not vacuous: each way a packed forward can let tokens see
    another sequence (or lose their positions) fails it, in fp32 and within bf16's tolerance."""
    model, batch = _model(dtype), _batch()
    _assert_packed_equal_padded(model, batch, "varlen", dtype)
    fault(monkeypatch)
    with pytest.raises(AssertionError, match="logp"):
        _assert_packed_equal_padded(model, batch, "varlen", dtype)


def test_varlen_layout_hands_the_kernel_its_cumulative_lengths(monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls: list = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "flash_attention_2", varlen_standin(calls))
    batch = _batch()
    model = _model(impl="flash_attention_2")
    assert packing.packing_support(model)[0] == "varlen"
    packed = _one_part("varlen", batch)
    with torch.no_grad():
        got = completion_logprobs(model, packed, temperature=0.9)
        model.config._attn_implementation = "sdpa"
        want = completion_logprobs(model, _one_part(None, batch), temperature=0.9)
    assert calls and set(calls) == {batch.labels.shape[0]}  # every layer, one span per sequence
    assert_close(got, want.double(), _tolerance(model, batch, torch.float32), "logp (varlen stand-in)")


def _one_row_layout(monkeypatch) -> list[int]:
    """Train with the one-row ("varlen") layout through SDPA's mask, so that every
    micro-batch's sequences share a row (the tiny model's sequences are too alike in length
    for the "rows" layout to put two in a row); returns the sequences per row seen."""
    import portarl.trainer.grpo as grpo
    import portarl.trainer.phases.micro_batches as mb

    monkeypatch.setattr(grpo, "resolve_padding_free", lambda cfg, model: None if cfg.train.padding_free is False
                        else LAYOUTS["varlen"])
    seen: list[int] = []
    real = mb.pack_micro_batch

    def spy(*args):
        out = real(*args)
        seen.append(int((out.position_ids == 0).sum()))
        return out

    monkeypatch.setattr(mb, "pack_micro_batch", spy)
    return seen


#: Training settings the packed gradients are checked under (here and in test_share_prompt.py).
STEP_SETTINGS = pytest.mark.parametrize("setting", [[], ["train.gradient_checkpointing=true"], ["model.lora.r=4"],
                                                    ["train.max_tokens_per_micro_batch=30"]],
                                        ids=["plain", "checkpointing", "lora", "budget"])


@pytest.mark.compares_runs
@STEP_SETTINGS
def test_gradients_equal_padded(tmp_path, monkeypatch, setting):
    if "model.lora.r=4" in setting:
        pytest.importorskip("peft")
    padded, trainer = _gradients(tmp_path, monkeypatch, "train.padding_free=true", *setting, name="rows")
    assert trainer.padding_free.kind == "rows"
    seen = _one_row_layout(monkeypatch)
    padded, trainer = _gradients(tmp_path, monkeypatch, "train.padding_free=false", *setting, name="padded")
    assert trainer.padding_free is None and not seen
    packed, trainer = _gradients(tmp_path, monkeypatch, "train.padding_free=true", *setting, name="packed")
    assert trainer.padding_free.kind == "varlen" and max(seen) > 1
    run_guard.assert_gradient_flows(padded, what=f"the padded step's gradients ({setting})")
    run_guard.assert_gradient_flows(packed, what=f"the packed step's gradients ({setting})")
    _assert_same(padded, packed)


@pytest.mark.compares_runs
def test_step_metrics_with_reference_and_entropy_equal_padded(make_trainer, monkeypatch):
    """A whole step with KL to a reference copy, old log-probs recomputed, entropy logged:
    every metric and the updated weights, packed vs padded, within fp32 tolerance."""
    seen = _one_row_layout(monkeypatch)
    want, got = (step_with_reference(make_trainer, f"train.padding_free={value}") for value in ("false", "true"))
    assert max(seen) > 1
    assert_steps_equal(want, got)


def step_with_reference(make_trainer, setting: str) -> tuple[dict, dict, dict]:
    """``(metrics row, parameters, parameters before the step)`` after one step with
    ``setting``, KL to a reference copy, old log-probs recomputed and entropy logged."""
    from trainer_fast import varied_reward

    trainer = make_trainer(setting, "loss.kl_coef=0.05", "train.old_logprobs=recompute", "data.max_operand=999",
                           "rollout.max_new_tokens=6", rewards=[varied_reward])
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    row = trainer.train_step()
    return row, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, start


def assert_steps_equal(want_run, got_run) -> None:
    """Two runs of :func:`step_with_reference`: both trained (tests/run_guard.py), and every
    metric (timings aside) and every updated weight within the fp32 tolerance."""
    (want, want_params, want_start), (got, got_params, got_start) = want_run, got_run
    run_guard.assert_trained([want["grad_norm"]], want_start, want_params, what="the reference step")
    run_guard.assert_trained([got["grad_norm"]], got_start, got_params, what="the step compared")
    keys = {k for k in want if not k.startswith("time/") and k != "_events"}
    assert {"kl", "entropy", "loss", "grad_norm", "mismatch/abs_diff_max"} <= keys, sorted(keys)
    for key in sorted(keys):
        a, b = want[key], got[key]
        if isinstance(a, float) and a == a:
            assert abs(a - b) <= fp32_result(abs(a)).atol, f"{key}: {a!r} vs {b!r}"
        else:
            assert a == b or (a != a and b != b), key
    for name, p in want_params.items():
        assert (got_params[name] - p).abs().max() <= fp32_result(float(p.abs().max())).atol, name


def test_models_that_pack_hf_directory_and_gguf(tmp_path):
    pytest.importorskip("gguf")
    from gguf_tiny import write_tiny_gguf
    from portarl.assets.models import load_local, save_local
    from portarl.assets.tokenizer import CharTokenizer

    save_local(tiny_qwen2(VOCAB), CharTokenizer(), tmp_path / "hf")
    write_tiny_gguf(tmp_path / "tiny.gguf")
    for path in (tmp_path / "hf", tmp_path / "tiny.gguf"):
        model, tok = load_local(path)
        assert packing.packing_support(model)[0] == "rows", path
        vocab = model.get_input_embeddings().weight.shape[0]
        rng = random.Random(3)
        batch = build_batch([[rng.randrange(vocab) for _ in range(n)] for n in (3, 1, 5, 2)],
                            [[rng.randrange(vocab) for _ in range(n)] for n in (4, 1, 0, 6)], 0, "cpu")
        _assert_packed_equal_padded(model, batch, "rows")


@pytest.fixture
def custom_attention(monkeypatch):
    """An attention implementation registered with transformers' AttentionInterface that
    transformers builds no mask for (as a third-party kernel would be)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "custom_kernel", sdpa_attention_forward)
    return "custom_kernel"


def test_unsupported_attention_falls_back_once_or_is_refused(tmp_path, custom_attention, caplog):
    from portarl.trainer import GRPOTrainer, build_from_config
    from portarl.trainer.config import ConfigError
    from trainer_fast import fast_config

    def trainer(value):
        cfg = fast_config(tmp_path / value, f"train.padding_free={value}")
        model, tokenizer, examples = build_from_config(cfg)
        model.config._attn_implementation = custom_attention
        return GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")

    with caplog.at_level(logging.INFO, logger="portarl.train"):
        tr = trainer("auto")
    assert tr.padding_free is None
    lines = [r.getMessage() for r in caplog.records if "padding-free" in r.getMessage()]
    assert len(lines) == 1 and "off, padded instead" in lines[0] and "custom_kernel" in lines[0], lines
    tr.train_step()  # padded micro-batches, no second line
    assert len([r for r in caplog.records if "padding-free" in r.getMessage()]) == 1
    with pytest.raises(ConfigError, match="train.padding_free=true: attention implementation 'custom_kernel'"):
        trainer("true")
    assert trainer("false").padding_free is None
    with pytest.raises(ConfigError, match="train.padding_free"):
        fast_config(tmp_path, "train.padding_free=sometimes")


def test_on_by_default_and_attn_implementation_setting(make_trainer):
    layout = make_trainer().padding_free  # sdpa, the default
    assert layout.kind == "rows" and layout.attention > 0 and not layout.longest_only
    trainer = make_trainer("model.attn_implementation=eager")
    assert trainer.model.config._attn_implementation == "eager" and trainer.padding_free.longest_only
    assert make_trainer("train.padding_free=false").padding_free is None


def test_micro_batch_rows_keep_the_padded_layout_for_blame():
    """A packed micro-batch's ``rows()`` (the non-finite blame re-runs a few rows) is padded:
    the packed layout belongs to the whole micro-batch."""
    part = _one_part("rows", _batch())
    assert part.rows(slice(0, 2)).packed is None
    assert dataclasses.replace(part, mask=part.mask).packed is part.packed
