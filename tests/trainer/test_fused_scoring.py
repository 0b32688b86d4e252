"""The trainer scores through ops.linear_logprobs: same numbers as the materialised-logits
path (fp32 and a bf16 model), gradients too, no full-vocabulary logits in the step, the
chunked non-finite blame, and the emulation profile still on its own path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import run_guard
from portarl.assets.models import tiny_qwen2
from portarl.parity.errors import assert_close
from portarl.parity.tolerances import Tolerance, fp32_result
from portarl.trainer.phases.sequences import MATERIALIZE_ENV, build_batch, completion_logprobs, nonfinite_logit_positions

sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
from test_memory_contract import AllocationLog  # noqa: E402

VOCAB = 3001


def _setup(dtype, tied=True):
    model = tiny_qwen2(VOCAB, hidden_size=32, intermediate_size=64, seed=3)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    model = model.to(dtype)
    batch = build_batch([[5, 6, 7], [8, 9]], [[10, 11, 12, 2], [13, 2]], 0, "cpu")
    return model, batch


def _score(model, batch, monkeypatch, materialize):
    monkeypatch.setenv(MATERIALIZE_ENV, "1" if materialize else "0")
    model.zero_grad()
    logp, ent = completion_logprobs(model, batch, temperature=0.9, with_entropy=True)
    (logp.sum() + 0.1 * ent.sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), ent.detach(), grads


@pytest.mark.compares_runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_fused_scoring_matches_materialised_logits(monkeypatch, dtype, tied):
    model, batch = _setup(dtype, tied)
    logp_f, ent_f, g_f = _score(model, batch, monkeypatch, materialize=False)
    logp_m, ent_m, g_m = _score(model, batch, monkeypatch, materialize=True)
    assert_close(logp_f, logp_m.double(), fp32_result(20.0), "logp")
    assert_close(ent_f, ent_m.double(), fp32_result(20.0), "entropy")
    run_guard.assert_gradient_flows(g_m, what="the materialised-logits path's gradients")
    run_guard.assert_gradient_flows(g_f, what="the fused path's gradients")
    assert set(g_f) == set(g_m)
    rtol = 1e-4 if dtype == torch.float32 else 2.0**-7  # bf16 gradients: two roundings apart
    for name in g_f:
        scale = float(g_m[name].abs().max())
        assert_close(g_f[name], g_m[name].double(), Tolerance(atol=rtol * scale + 1e-6, rtol=rtol), name)


def test_no_full_vocabulary_tensor_in_a_scoring_step(monkeypatch):
    model, _ = _setup(torch.float32)
    completions = [[10 + (i % 50) for i in range(60)], [20 + (i % 40) for i in range(45)]]
    batch = build_batch([[5, 6, 7], [8, 9]], completions, 0, "cpu")  # N*V = 120 * 3001 > V*H
    monkeypatch.setenv(MATERIALIZE_ENV, "0")
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", "50000")  # tiles smaller than N x V at this size
    n_by_v = batch.labels.numel() * VOCAB
    log = AllocationLog()
    with log:
        logp = completion_logprobs(model, batch, temperature=1.0)
        logp.sum().backward()
    assert max(n for _, n in log.sizes) < n_by_v
    monkeypatch.setenv(MATERIALIZE_ENV, "1")
    log = AllocationLog()
    with log:
        completion_logprobs(model, batch, temperature=1.0).sum().backward()
    assert max(n for _, n in log.sizes) >= n_by_v  # the watcher sees the old path's logits


def test_chunked_blame_finds_nonfinite_logits(monkeypatch):
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", str(2 * VOCAB))  # two rows per chunk
    model, batch = _setup(torch.float32)
    assert not nonfinite_logit_positions(model, batch).any()
    with torch.no_grad():
        model.lm_head.weight[7, 0] = float("inf")  # tied: also embedding row 7 (not in the batch)
    bad = nonfinite_logit_positions(model, batch)
    assert bad.equal(batch.mask)


def test_emulation_profile_keeps_its_own_path():
    from portarl.backends.emulation import resolve_profile

    model, batch = _setup(torch.bfloat16)
    emulate = resolve_profile("npu-emulated")
    logp, ent = completion_logprobs(model, batch, temperature=1.0, with_entropy=True, emulate=emulate)
    # bf16-valued log-probs: a property of the emulated stack, not of portarl's fused path.
    assert torch.equal(logp, logp.to(torch.bfloat16).float())
