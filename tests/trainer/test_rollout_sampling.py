"""The hf engine's on-device sampler: Philox known answers, the sampled distribution
(chi-square against softmax(z/T) restricted to top-k / top-p), independence across positions,
batch-composition independence, and rollout log-probs equal to the trainer's forward.

Statistical tests use fixed seeds, so they are deterministic; the threshold p < 1e-3 is their
false-positive rate for a random choice of seeds. Each has a negative control (the same
statistic against a wrong distribution) to show it can fail.
"""

from __future__ import annotations

import pytest
import torch

from portarl.assets.models import build_tiny
from portarl.rollout import HFRollout, SamplingParams, request_seeds, sample_seed
from portarl.rollout.hf import _last_logits_kwargs
from portarl.rollout.sampling import filter_logits, philox4x32, sample_tokens, seed_keys, uniform_span, uniforms
from portarl.trainer.phases.sequences import build_batch, completion_logprobs

ALPHA = 1e-3
N = 40_000


def _chi2_p(counts: torch.Tensor, probs: torch.Tensor, dof: int | None = None) -> float:
    """p-value of Pearson's chi-square over the cells with probs > 0 (upper gamma tail)."""
    keep = probs > 0
    expected = probs[keep].double() * counts.sum()
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1 if dof is None else dof
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def _keys(n: int, step: int = 1) -> torch.Tensor:
    return seed_keys([sample_seed(7, step, i // 8, i % 8) for i in range(n)], "cpu")


@pytest.mark.parametrize("counter,key,expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expected):
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    assert tuple(int(w) for w in philox4x32(tuple(map(t, counter)), tuple(map(t, key)))) == expected


def test_uniforms_are_uniform_and_open():
    u = uniforms(_keys(64), position=3, vocab=1000).flatten()
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u, bins=50, min=0, max=1)
    assert _chi2_p(counts, torch.full((50,), 1 / 50)) > ALPHA


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.8, 0, 0.8),
                                                     (1.0, 6, 0.9)])
def test_samples_follow_the_filtered_softmax(temperature, top_k, top_p):
    z = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0])
    target = torch.softmax(filter_logits(z[None] / temperature, top_k, top_p)[0], -1)
    tokens = sample_tokens(z.expand(N, -1), _keys(N), 2, temperature=temperature, top_k=top_k, top_p=top_p)
    counts = torch.bincount(tokens, minlength=z.numel()).double()
    assert counts[target == 0].sum() == 0, "a token outside the top-k / top-p set was drawn"
    assert _chi2_p(counts, target) > ALPHA
    wrong = torch.softmax(filter_logits(z[None], top_k, top_p)[0] / (temperature * 1.15), -1)
    assert _chi2_p(counts, wrong) < ALPHA, "negative control: a 15% temperature error must be detected"


def test_positions_and_seeds_draw_independently():
    z = torch.tensor([0.4, 0.1, -0.2, -0.6])
    keys = _keys(N)
    first, second = (sample_tokens(z.expand(N, -1), keys, t, temperature=1.0) for t in (0, 1))
    joint = torch.bincount(first * 4 + second, minlength=16).double()
    p = torch.softmax(z, -1)
    assert _chi2_p(joint, (p[:, None] * p[None, :]).flatten()) > ALPHA
    same = torch.bincount(first * 4 + first, minlength=16).double()  # control: fully dependent pairs
    assert _chi2_p(same, (p[:, None] * p[None, :]).flatten()) < ALPHA
    # neighbouring seeds (consecutive samples of a group) are not correlated either
    pairs = torch.bincount(first[0::2] * 4 + first[1::2], minlength=16).double()
    assert _chi2_p(pairs, (p[:, None] * p[None, :]).flatten()) > ALPHA


def test_a_row_draws_the_same_whatever_the_batch():
    z = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    keys = _keys(6)
    batch = sample_tokens(z, keys, 4, temperature=0.9, top_p=0.95)
    alone = torch.cat([sample_tokens(z[i : i + 1], keys[i : i + 1], 4, temperature=0.9, top_p=0.95) for i in range(6)])
    assert torch.equal(batch, alone)
    assert torch.equal(uniforms(keys, 4, 50)[2:3], uniforms(keys[2:3], 4, 50))
    span = uniform_span(keys, 3, 4, 50)  # several positions per call: the same values
    assert torch.equal(span, torch.stack([uniforms(keys, t, 50) for t in range(3, 7)], dim=1))


def _engine(**kw):
    model, tok = build_tiny(seed=3)
    return HFRollout(model, tok.eos_token_id, tok.pad_token_id, **kw), tok


def test_engine_sample_matches_a_batch_of_one_with_other_prompt_lengths():
    engine, tok = _engine()
    prompts = [tok.encode("3+4="), tok.encode("12+7=5"), tok.encode("1="), tok.encode("3+4=")]
    seeds = request_seeds(0, 1, 4, 1)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    both = engine.generate(prompts, seeds, params)
    for i in range(4):
        alone = engine.generate(prompts[i : i + 1], seeds[i : i + 1], params)
        assert alone.completion_ids[0] == both.completion_ids[i]
        assert alone.logprobs[0] == pytest.approx(both.logprobs[i], abs=1e-5)
    # the same prompt with another seed differs; with the same seed it repeats
    assert both.completion_ids[0] != both.completion_ids[3]
    again = engine.generate(prompts, seeds, params)
    assert again.completion_ids == both.completion_ids


def test_rollout_logprobs_equal_the_trainers_forward():
    engine, tok = _engine()
    prompts = [tok.encode("3+4="), tok.encode("12+7="), tok.encode("5=")] * 2
    params = SamplingParams(max_new_tokens=7, temperature=0.8, top_k=20)
    out = engine.generate(prompts, request_seeds(1, 2, 3, 2), params)
    batch = build_batch(out.prompt_ids, out.completion_ids, tok.pad_token_id, "cpu")
    with torch.no_grad():
        trainer = completion_logprobs(engine.model, batch, temperature=0.8)
    for i, lp in enumerate(out.logprobs):
        assert lp == pytest.approx(trainer[i, : len(lp)].tolist(), abs=1e-5)


def test_greedy_is_the_argmax_of_a_full_forward():
    engine, tok = _engine()
    prompt = tok.encode("7+8=")
    out = engine.generate([prompt], [123], SamplingParams(max_new_tokens=6, greedy=True))
    seq, expected = list(prompt), []
    with torch.no_grad():
        for _ in range(6):
            nxt = int(engine.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            expected.append(nxt)
            seq.append(nxt)
            if nxt == tok.eos_token_id:
                break
    assert out.completion_ids[0] == expected
    assert engine.generate([prompt], [999], SamplingParams(max_new_tokens=6, greedy=True)).completion_ids == [expected]


def test_extra_stop_tokens_end_a_completion():
    engine, tok = _engine()
    prompt, params = tok.encode("7+8="), SamplingParams(max_new_tokens=8)
    free = engine.generate([prompt], [5], params).completion_ids[0]
    j = next(j for j in range(1, len(free)) if free[j] not in free[:j] and free[j] != tok.eos_token_id)
    stopped, _ = _engine(stop_token_ids=[tok.eos_token_id, free[j]])
    out = stopped.generate([prompt], [5], params)
    assert out.completion_ids[0] == free[: j + 1] and out.finished == [True]
    assert engine.stop_token_ids == (tok.eos_token_id,)
    with pytest.raises(ValueError, match="stop_token_ids"):
        _engine(stop_token_ids=[])


def test_prefill_computes_the_head_on_the_last_position_only():
    engine, tok = _engine()
    assert _last_logits_kwargs(engine.model) == {"logits_to_keep": 1}
    rows = []
    hook = engine.model.get_output_embeddings().register_forward_hook(lambda m, a, o: rows.append(a[0].shape[1]))
    try:
        engine.generate([tok.encode("12+30=")] * 2, [1, 2], SamplingParams(max_new_tokens=3))
    finally:
        hook.remove()
    assert rows and set(rows) == {1}


def test_drawing_several_positions_per_call_changes_no_sample(monkeypatch):
    import portarl.rollout.hf as hf

    engine, tok = _engine()
    prompts, seeds = [tok.encode("3+4="), tok.encode("12+7=")] * 3, request_seeds(2, 1, 2, 3)
    params = SamplingParams(max_new_tokens=7, top_k=30)
    grouped = engine.generate(prompts, seeds, params)
    monkeypatch.setattr(hf, "NOISE_WORDS_PER_CALL", 1)  # one position per Philox / log-prob call
    single = engine.generate(prompts, seeds, params)
    assert single.completion_ids == grouped.completion_ids
    for a, b in zip(single.logprobs, grouped.logprobs):
        assert a == pytest.approx(b, abs=1e-6)


def _prefill_rows(engine, prompts, seeds, params):
    """(the batch, the row counts of the forwards that saw more than one position)."""
    rows = []
    hook = engine.model.register_forward_pre_hook(
        lambda m, args, kw: rows.append(kw["input_ids"].shape[0]) if kw["input_ids"].shape[1] > 1 else None,
        with_kwargs=True)
    try:
        return engine.generate(prompts, seeds, params), rows
    finally:
        hook.remove()


def test_share_prefill_prefills_a_repeated_prompt_once_and_samples_are_unchanged(monkeypatch):
    import transformers

    import portarl.rollout.hf as hf

    engine, tok = _engine()
    a, b = tok.encode("3+4="), tok.encode("12+7=")
    prompts, seeds = [a, a, a, b, b, b, a], request_seeds(4, 1, 7, 1)
    params = SamplingParams(max_new_tokens=6, top_k=30)
    assert _prefill_rows(engine, prompts, seeds, params)[1] == [7]  # off by default: every row
    engine.share_prefill = True
    shared, rows = _prefill_rows(engine, prompts, seeds, params)
    assert rows == [2]  # the two distinct prompts, once each
    assert len({tuple(c) for c in shared.completion_ids[:3]}) > 1  # per-sample seeds still differ

    def every_row(ps):
        return [list(p) for p in ps], list(range(len(ps)))

    with monkeypatch.context() as m:
        m.setattr(hf, "_distinct_rows", every_row)
        plain, rows = _prefill_rows(engine, prompts, seeds, params)
    assert rows == [7]
    # a cache that cannot copy rows: the distinct forward is dropped, every row is prefilled
    monkeypatch.setattr(transformers.cache_utils.Cache, "reorder_cache", None)
    fallback, rows = _prefill_rows(engine, prompts, seeds, params)
    assert rows == [2, 7]
    for other in (plain, fallback):
        assert other.completion_ids == shared.completion_ids
        for x, y in zip(other.logprobs, shared.logprobs):
            assert x == pytest.approx(y, abs=1e-5)


@pytest.mark.parametrize("lean", [True, False])
def test_decoding_n_tokens_takes_one_prefill_and_n_minus_1_forwards(lean):
    """Nothing samples from the logits after the last token: no forward is spent on them
    (lean decode steps and Hugging Face forwards alike)."""
    engine, tok = _engine(lean_decode=lean)
    prefills, steps = [], []
    make = engine._decoder

    def counting_decoder(*args, **kwargs):
        step, keep = make(*args, **kwargs)
        return (lambda tokens, positions: steps.append(1) or step(tokens, positions)), keep

    engine._decoder = counting_decoder
    hook = engine.model.register_forward_pre_hook(
        lambda m, args, kw: prefills.append(1) if kw["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    try:
        out = engine.generate([tok.encode("3+4="), tok.encode("12+7=")], [1, 2], SamplingParams(max_new_tokens=5))
    finally:
        hook.remove()
    assert engine.decode_path == "lean" if lean else engine.decode_path.startswith("hf (rollout.lean_decode is off")
    assert max(len(c) for c in out.completion_ids) == 5  # a row ran to the limit: no early stop
    assert len(prefills) == 1 and len(steps) == 4
