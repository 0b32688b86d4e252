"""Vision-language models on portarl's numerics path (issue 47): the tiny Qwen2-VL,
Qwen2.5-VL and Qwen3-VL (built from a config, with their processors) score completions
with the fused linear log-probs from ``model.model``'s hidden states, with M-RoPE
positions from the model's own ``get_rope_index``.

Held here: the trainer's log-probs equal transformers' own full forward (its positions,
its logits); padded, padding-free and shared-prompt layouts agree within the fp32
tolerance (bf16: two roundings apart), and the same check with positions built as 1-D
fails (the bug of verl #6040 / AReaL #217); equal prompt tokens with other images are not
shared; the hf engine's rollout log-probs equal the trainer's and it never samples an
image placeholder; freezing the vision tower."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import run_guard

from portarl.assets.data import Example
from portarl.parity.errors import assert_close
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL, fp32_result, low_precision_forward
from portarl.rollout.base import SamplingParams
from portarl.rollout.hf import HFRollout
from portarl.trainer.memory.checkpointing import checkpointing_enabled, enable_checkpointing
from portarl.trainer.phases.packing import layout_of, pack_micro_batch
from portarl.trainer.phases.sequences import build_batch, completion_logprobs
from portarl.vision.codec import VisionCodec
from portarl.vision.images import ImageSource
from portarl.vision.models import BUILTIN_VLMS, build_tiny_vlm, freeze_vision, vision_parts

PIL = pytest.importorskip("PIL.Image")

NAMES = list(BUILTIN_VLMS)
GROUP = 2


def _png(tmp, name, size, colour) -> ImageSource:
    path = tmp / f"{name}.png"
    PIL.new("RGB", size, colour).save(path)
    return ImageSource(str(path), None, name)


def _question(*parts):
    return ({"role": "user", "content": tuple(parts)},)


IMAGE, TEXT = {"type": "image"}, lambda t: {"type": "text", "text": t}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("images")
    return {"red": _png(tmp, "red", (40, 60), (255, 0, 0)), "green": _png(tmp, "green", (90, 30), (0, 200, 0)),
            "blue": _png(tmp, "blue", (50, 50), (0, 0, 255)), "blue2": _png(tmp, "blue2", (40, 60), (0, 0, 255))}


def _examples(images):
    """One image, two images around text, and a text-only prompt."""
    return [Example(_question(IMAGE, TEXT("what colour?")), "red", {}, "row 0", (images["red"],)),
            Example(_question(TEXT("two:"), IMAGE, IMAGE), "green", {}, "row 1", (images["green"], images["blue"])),
            Example("plain text prompt", "x", {}, "row 2")]


@pytest.fixture(scope="module", params=NAMES)
def vlm(request, images):
    model, processor = build_tiny_vlm(request.param, seed=1)
    model.eval()
    codec = VisionCodec(processor, model)
    examples = _examples(images)
    prompts = [codec.encode_example(ex) for ex in examples]
    return request.param, model, codec, examples, prompts


def _completions(count, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 5, 2, 4, 6, 1, 4, 2][:count]
    return [torch.randint(10, 200, (n,), generator=g).tolist() for n in lengths]


def _batch(codec, examples, prompts, completions):
    rows = [p for p in prompts for _ in range(GROUP)]
    return build_batch(rows, completions, codec.pad_token_id, "cpu", vision=codec.batch_vision(examples, GROUP))


def _packed(model, batch, share: bool, by_tokens_only: bool = False):
    prompt_lens = batch.attention_mask[:, : batch.prompt_width].sum(-1).tolist()
    completion_lens = (batch.labels != -100).sum(-1).tolist()
    layout = dataclasses.replace(layout_of(model.config.text_config, "rows"), share_prompt=share)
    keys = None
    if share:
        keys = [tuple(r[batch.prompt_width - p:]) + ((() if by_tokens_only else ("vision", k)),) for r, p, k in
                zip(batch.input_ids[:, : batch.prompt_width].tolist(), prompt_lens, batch.vision.prompt_keys)]
    return dataclasses.replace(batch, packed=pack_micro_batch(batch, prompt_lens, completion_lens, layout, keys))


def _scale(model, batch) -> float:
    with torch.no_grad():
        from portarl.trainer.phases.sequences import completion_logits

        return float(completion_logits(model, batch).abs().max())


def test_the_trainer_scores_what_the_models_own_forward_computes(vlm):
    """Each row alone through transformers' full forward (its get_rope_index, its lm_head):
    the trainer's batched log-probs equal it."""
    name, model, codec, examples, prompts = vlm
    completions = _completions(len(examples) * GROUP)
    batch = _batch(codec, examples, prompts, completions)
    with torch.no_grad():
        ours = completion_logprobs(model, batch, temperature=1.0)
        for i, (p, c) in enumerate(zip([p for p in prompts for _ in range(GROUP)], completions)):
            enc = codec._process(examples[i // GROUP])
            ids = torch.tensor([p + c])
            extra = {}
            if enc.get("pixel_values") is not None:
                kinds = torch.cat([enc["mm_token_type_ids"], torch.zeros(1, len(c), dtype=torch.long)], dim=1)
                extra = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"],
                         "mm_token_type_ids": kinds}
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0, len(p) - 1 : -1]
            theirs = logits.double().log_softmax(-1).gather(-1, torch.tensor(c)[:, None])[:, 0]
            assert_close(ours[i, : len(c)].double(), theirs, fp32_result(float(logits.abs().max())),
                         what=f"{name} row {i}: trainer vs transformers' forward")


@pytest.mark.parametrize("share", [False, True], ids=["padding-free", "shared-prompt"])
def test_packed_layouts_match_the_padded_one_and_1d_positions_would_not(vlm, share):
    name, model, codec, examples, prompts = vlm
    batch = _batch(codec, examples, prompts, _completions(len(examples) * GROUP))
    packed = _packed(model, batch, share)
    if share:
        assert packed.packed.attention_mask is not None, "the group's prompts were not shared"
    with torch.no_grad():
        padded = completion_logprobs(model, batch, temperature=1.0)
        tol = fp32_result(_scale(model, batch))
        assert_close(completion_logprobs(model, packed, temperature=1.0), padded, tol,
                     what=f"{name}: {'shared-prompt' if share else 'padding-free'} vs padded")
        # The same comparison with 1-D positions (0, 1, ... per row) misses by more than the tolerance.
        flat = dataclasses.replace(batch, vision=dataclasses.replace(
            batch.vision, rope=batch.position_ids[None].expand(3, -1, -1).clone()))
        gap = (completion_logprobs(model, flat, temperature=1.0) - padded).abs().max()
    assert float(gap) > float(tol.allowed(padded).max()), f"{name}: 1-D positions are indistinguishable here"


def test_causal_rows_over_the_mask_bound_match_the_padded_one(vlm, monkeypatch):
    """Over the attention-mask bound (lowered here: portarl/trainer/phases/attention_masks.py)
    each sequence has a row of its own whose tail continues its text positions: no mask, and
    the M-RoPE positions gathered as in any packed layout."""
    import portarl.trainer.phases.attention_masks as masks
    from transformers.masking_utils import find_packed_sequence_indices

    monkeypatch.setattr(masks, "DENSE_MASK_BOUND_BYTES", 0)
    name, model, codec, examples, prompts = vlm
    batch = _batch(codec, examples, prompts, _completions(len(examples) * GROUP))
    packed = _packed(model, batch, share=True)
    assert packed.packed.attention_mask is None and find_packed_sequence_indices(packed.packed.position_ids) is None
    with torch.no_grad():
        padded = completion_logprobs(model, batch, temperature=1.0)
        assert_close(completion_logprobs(model, packed, temperature=1.0), padded, fp32_result(_scale(model, batch)),
                     what=f"{name}: causal rows vs padded")


def test_bf16_packed_matches_padded_within_two_roundings(images):
    model, processor = build_tiny_vlm("tiny-qwen2.5-vl", seed=1)
    model = model.to(torch.bfloat16).eval()
    codec = VisionCodec(processor, model)
    examples = _examples(images)
    prompts = [codec.encode_example(ex) for ex in examples]
    batch = _batch(codec, examples, prompts, _completions(len(examples) * GROUP))
    batch.vision.pixels = [None if p is None else p.to(torch.bfloat16) for p in batch.vision.pixels]
    with torch.no_grad():
        padded = completion_logprobs(model, batch, temperature=1.0)
        packed = completion_logprobs(model, _packed(model, batch, False), temperature=1.0)
    assert_close(packed, padded, low_precision_forward(_scale(model, batch), torch.bfloat16),
                 what="bf16 padding-free vs padded")


def test_equal_prompt_tokens_with_other_images_are_not_shared(images):
    """Two rows whose text and image size are equal (the same tokens) but whose images
    differ: a shared-prompt layout keyed by tokens alone would score one image for both."""
    model, processor = build_tiny_vlm("tiny-qwen2.5-vl", seed=1)
    model.eval()
    codec = VisionCodec(processor, model)
    examples = [Example(_question(IMAGE, TEXT("colour?")), "red", {}, "a", (images["red"],)),
                Example(_question(IMAGE, TEXT("colour?")), "blue", {}, "b", (images["blue2"],))]
    prompts = [codec.encode_example(ex) for ex in examples]
    assert prompts[0] == prompts[1]
    batch = _batch(codec, examples, prompts, _completions(len(examples) * GROUP, seed=3))
    tol = fp32_result(_scale(model, batch))
    with torch.no_grad():
        padded = completion_logprobs(model, batch, temperature=1.0)
        shared = completion_logprobs(model, _packed(model, batch, True), temperature=1.0)
        # What grouping by tokens alone would score: the second image's rows read the first image.
        wrong = completion_logprobs(model, _packed(model, batch, True, by_tokens_only=True), temperature=1.0)
    assert_close(shared, padded, tol, what="shared-prompt rows with other images")
    assert float((wrong - padded).abs().max()) > float(tol.allowed(padded).max())


def test_the_hf_engine_samples_with_pixels_and_never_an_image_placeholder(vlm):
    name, model, codec, examples, prompts = vlm
    head = model.get_output_embeddings()
    with torch.no_grad():  # make <|image_pad|> the likeliest token everywhere: the engine must still not draw it
        saved = head.weight[codec.image_token_id].clone()
        head.weight[codec.image_token_id] = head.weight[codec.image_token_id] * 0 + 3.0
    try:
        engine = HFRollout(model, codec.eos_token_id, codec.pad_token_id, stop_token_ids=codec.stop_token_ids)
        rows = [p for p in prompts for _ in range(GROUP)]
        out = engine.generate(rows, list(range(len(rows))), SamplingParams(max_new_tokens=6),
                              media=codec.batch_vision(examples, GROUP))
        sampled = [t for c in out.completion_ids for t in c]
        assert codec.image_token_id not in sampled
        batch = _batch(codec, examples, prompts, out.completion_ids)
        with torch.no_grad():
            trainer = completion_logprobs(model, batch, temperature=1.0)
        engine_lp = torch.zeros_like(trainer)
        for i, lp in enumerate(out.logprobs):
            engine_lp[i, : len(lp)] = torch.tensor(lp)
        assert (trainer - engine_lp).abs().max() <= ROLLOUT_FP32_ATOL, f"{name}: rollout vs trainer log-probs"
        assert float(trainer[batch.mask].exp().max()) < 1.0  # the placeholder kept its probability mass
    finally:
        with torch.no_grad():
            head.weight[codec.image_token_id] = saved


@pytest.mark.parametrize("projector", [False, True])
def test_freezing_the_vision_tower_keeps_the_projector_when_asked(projector):
    model, _ = build_tiny_vlm("tiny-qwen3-vl")
    frozen = freeze_vision(model, train_projector=projector)
    tower, merger = vision_parts(model)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert frozen > 0
    assert all(id(p) in trainable for p in model.model.language_model.parameters())
    assert all((id(p) in trainable) == projector for p in merger.parameters())
    assert not any(id(p) in trainable for n, p in tower.named_parameters()
                   if not n.startswith(("merger", "deepstack_merger_list")))


@pytest.mark.compares_runs
def test_activation_checkpointing_gives_the_same_gradients(images):
    """``train.gradient_checkpointing`` (on by default for a model directory) recomputes the
    language model's layers in the backward, with the same M-RoPE positions and image
    features: the gradients equal those without it within the fp32 tolerance."""
    grads = []
    for checkpointing in (False, True):
        model, processor = build_tiny_vlm("tiny-qwen2.5-vl", seed=1)
        freeze_vision(model, train_projector=True)
        if checkpointing:
            enable_checkpointing(model)  # what the trainer does
            assert checkpointing_enabled(model) and model.model.language_model.gradient_checkpointing
        model.train()
        codec = VisionCodec(processor, model)
        examples = _examples(images)
        prompts = [codec.encode_example(ex) for ex in examples]
        batch = _batch(codec, examples, prompts, _completions(len(examples) * GROUP))
        logp = completion_logprobs(model, _packed(model, batch, False), temperature=1.0)
        (-(logp * batch.mask).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("merger" in n for n in grads[0])
    for checkpointing, g in zip((False, True), grads):
        run_guard.assert_gradient_flows(g, what=f"the VLM step's gradients (checkpointing {checkpointing})")
    for name, g in grads[0].items():
        assert_close(grads[1][name], g, fp32_result(float(g.abs().max())), what=f"checkpointed gradient of {name}")
