"""Bounded rollout memory: the hf engine generates at most ``max_batch_size`` sequences at
once (``rollout.max_batch_size``), and the samples equal those of one batch."""

from __future__ import annotations

import pytest
import torch

from portarl.assets.models import build_tiny
from portarl.rollout import HFRollout, SamplingParams, request_seeds


@pytest.mark.parametrize("lean", [True, False])
def test_chunks_give_the_one_batch_samples_and_bound_the_batch(lean):
    model, tok = build_tiny(seed=3)
    prompts = [tok.encode(text) for text in ("3+4=", "12+345=", "7=", "1+2+3=", "99+1=") for _ in range(3)]
    seeds = request_seeds(0, 1, 5, 3)
    params = SamplingParams(max_new_tokens=7)
    whole = HFRollout(model, tok.eos_token_id, tok.pad_token_id, lean_decode=lean).generate(prompts, seeds, params)
    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                           with_kwargs=True)
    chunked = HFRollout(model, tok.eos_token_id, tok.pad_token_id, lean_decode=lean, max_batch_size=4)
    parts = chunked.generate(prompts, seeds, params)
    hook.remove()
    assert rows and max(rows) <= 4  # at most 4 sequences in any forward (prefill; the lean decode skips this hook)
    assert parts.prompt_ids == whole.prompt_ids and parts.completion_ids == whole.completion_ids
    assert parts.finished == whole.finished
    # Same tokens; log-probs from a forward over fewer rows / less left padding: equal
    # within fp32 rounding (CPU GEMMs may pick another kernel for another batch size).
    for a, b in zip(parts.logprobs, whole.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


def test_max_batch_size_is_checked():
    model, tok = build_tiny(seed=3)
    with pytest.raises(ValueError, match="rollout.max_batch_size"):
        HFRollout(model, tok.eos_token_id, tok.pad_token_id, max_batch_size=0)


def test_the_config_reaches_the_engine(make_trainer):
    assert make_trainer("rollout.max_batch_size=3").rollout.max_batch_size == 3
    assert make_trainer().rollout.max_batch_size == 256  # the default bound
