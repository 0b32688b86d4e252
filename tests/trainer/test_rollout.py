"""Rollout: per-sample seeds give distinct samples, constant seeds fire the identical-samples
detector, sampling filters, log-probs recorded with the trainer's temperature."""

from __future__ import annotations

import json

import pytest
import torch

from portarl import ops
from portarl.assets.models import build_tiny
from portarl.rollout import HFRollout, SamplingParams, identical_group_fraction, request_seeds, sample_seed
from portarl.rollout.hf import filter_logits


def _engine():
    model, tok = build_tiny(seed=3)
    return HFRollout(model, tok.eos_token_id, tok.pad_token_id), tok


def test_stop_token_list_as_eos_is_refused_with_the_fix():
    """A list of stop tokens passed where the single eos id goes must not fail deep inside
    (it did: ``unhashable type: 'list'``); the error names stop_token_ids."""
    model, tok = build_tiny(seed=3)
    with pytest.raises(TypeError, match="stop_token_ids"):
        HFRollout(model, [tok.eos_token_id, 5], tok.pad_token_id)


def test_per_sample_seeds_give_distinct_samples():
    engine, tok = _engine()
    prompts = [tok.encode("3+4=")] * 8
    batch = engine.generate(prompts, request_seeds(0, 1, 1, 8), SamplingParams(max_new_tokens=6))
    assert len({tuple(c) for c in batch.completion_ids}) >= 6
    assert identical_group_fraction(batch.completion_ids, 8) == 0.0


def test_constant_seed_gives_identical_samples():
    engine, tok = _engine()
    prompts = [tok.encode("3+4=")] * 4 + [tok.encode("5+5=")] * 4
    batch = engine.generate(prompts, request_seeds(0, 1, 2, 4, mode="constant"), SamplingParams(max_new_tokens=6))
    assert identical_group_fraction(batch.completion_ids, 4) == 1.0


def test_identical_samples_detector_fires_in_training(make_trainer):
    trainer = make_trainer("rollout.seed_mode=constant", "train.steps=1")
    trainer.train()
    row = json.loads((trainer.output_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rollout/identical_group_frac"] == 1.0
    events = [json.loads(line) for line in (trainer.output_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "identical_samples" for e in events)


def test_samples_do_not_depend_on_batch_composition():
    engine, tok = _engine()
    seeds = request_seeds(0, 1, 2, 3)
    both = engine.generate([tok.encode("3+4=")] * 3 + [tok.encode("12+7=")] * 3, seeds, SamplingParams(max_new_tokens=5))
    alone = engine.generate([tok.encode("3+4=")] * 3, seeds[:3], SamplingParams(max_new_tokens=5))
    assert both.completion_ids[:3] == alone.completion_ids


def test_seeds_are_unique_per_sample():
    seeds = {sample_seed(0, s, p, i) for s in range(3) for p in range(4) for i in range(8)}
    assert len(seeds) == 3 * 4 * 8


def test_recorded_logprobs_use_the_temperature():
    engine, tok = _engine()
    params = SamplingParams(max_new_tokens=1, temperature=0.7)
    batch = engine.generate([tok.encode("1+1=")], [5], params)
    ids = torch.tensor([tok.encode("1+1=")])
    logits = engine.model(input_ids=ids).logits[:, -1]
    token = torch.tensor(batch.completion_ids[0][:1])
    expected = ops.logprobs(logits, token, temperature=0.7)
    assert abs(batch.logprobs[0][0] - float(expected.detach())) < 1e-5


def test_filters():
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(z, top_k=2, top_p=1.0)[0, 2:]).all()
    kept = filter_logits(z, top_k=0, top_p=0.7)  # softmax: 0.64, 0.24, ...: top two cover 0.7
    assert torch.isfinite(kept[0, :2]).all() and torch.isinf(kept[0, 2:]).all()
