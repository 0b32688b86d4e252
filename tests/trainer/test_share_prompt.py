"""Shared-prompt rows (``train.share_prompt``, portarl/trainer/phases/share_prompt.py): a
group's prompt held once, each completion attending to it and causally to itself only.
Log-probs, entropy, a loss and its gradients equal the padded path's within the fp32
tolerance (bf16: within its tolerance), for several groups per micro-batch of different
prompt lengths and mixed completion lengths (empty, one token, cut at max_new_tokens,
ending with EOS); a mask that lets completions see each other, or positions that do not
continue the prompt, fail the check; unsupported settings are refused (true) or off (auto)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import portarl.trainer.phases.share_prompt as share_prompt
import run_guard
from portarl.parity.errors import assert_close
from portarl.parity.tolerances import fp32_result
from portarl.trainer.config.fields import ConfigError
from portarl.trainer.phases.micro_batches import micro_batches
from portarl.trainer.phases.sequences import build_batch, completion_logprobs
from test_memory_checkpointing import _assert_same, _gradients
from test_padding_free import (LAYOUTS, STEP_SETTINGS, VOCAB, _fake_trainer, _model, _tolerance, assert_steps_equal,
                               step_with_reference)

EOS = 2
MAX_NEW = 8


def _groups_batch(seed=0, groups=((4, (8, 0, 1, 8, 3, 5)), (2, (5, 5, 1, 8)), (6, (2, 7, 0)), (3, (8,)))):
    """Groups (prompt length, completion lengths) back to back as the rollout lays them out;
    a completion shorter than ``MAX_NEW`` ends with EOS, one of ``MAX_NEW`` tokens is cut."""
    rng = random.Random(seed)
    prompts, completions = [], []
    for p, lengths in groups:
        prompt = [rng.randrange(3, VOCAB) for _ in range(p)]
        for c in lengths:
            body = [rng.randrange(3, VOCAB) for _ in range(c)]
            if 0 < c < MAX_NEW:
                body[-1] = EOS
            prompts.append(prompt)
            completions.append(body)
    return build_batch(prompts, completions, 0, "cpu")


def _shared(kind="rows", dtype=None):
    return dataclasses.replace(LAYOUTS[kind], share_prompt=True, mask_dtype=dtype)


def _part(layout, batch):
    (rows, part), = micro_batches(_fake_trainer(layout), batch)
    return part


def _logprobs(model, part):
    return completion_logprobs(model, part, temperature=0.9, with_entropy=True)


def _assert_shared_equal_padded(model, batch, layout, dtype=torch.float32):
    padded, shared = _part(None, batch), _part(layout, batch)
    assert shared.packed is not None and shared.packed.attention_mask is not None, "the shared layout was not used"
    real = int(batch.attention_mask.sum())
    assert shared.packed.input_ids.numel() < real  # the prompts once, no last completion tokens
    with torch.no_grad():
        want, got = _logprobs(model, padded), _logprobs(model, shared)
    tol = _tolerance(model, batch, dtype)
    for name, w, g in zip(("logp", "entropy"), want, got):
        assert g.shape == w.shape == batch.labels.shape
        assert bool((g[~batch.mask] == 0).all()), f"{name}: non-zero where there is no completion token"
        assert_close(g, w.double(), tol, f"{name} (shared, {dtype})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["rows", "longest"])
def test_shared_logprobs_and_entropy_equal_padded(dtype, impl, kind):
    for seed in (0, 1):
        model = _model(dtype, impl, seed=seed)
        _assert_shared_equal_padded(model, _groups_batch(seed), _shared(kind, dtype if impl == "eager" else None),
                                    dtype)


def test_layout_holds_each_prompt_once_and_scores_every_completion_token():
    batch = _groups_batch()
    p = _part(_shared(), batch).packed
    flat = p.input_ids.reshape(-1)
    labels = batch.labels.reshape(-1)[p.where]
    assert bool((labels != -100).all()) and p.where.numel() == int(batch.mask.sum())
    # Each scored position is followed (in its own sequence) by its label: the first token
    # of every completion is scored from its prompt's last position, which is shared.
    assert len(set(p.scored.tolist())) < p.scored.numel()
    # 4 + 7+0+0+7+2+4, 2 + 4+4+0+7, 6 + 1+6, 3 + 7 tokens (and the tails of the rows)
    assert int((p.attention_mask.diagonal(dim1=-2, dim2=-1)).sum()) == p.input_ids.numel()
    assert flat.numel() >= 24 + 17 + 13 + 10


def _loss_and_grads(model, part, weights):
    model.zero_grad()
    logp, entropy = _logprobs(model, part)
    tokens = part.mask.sum()  # a token-mean loss, as the trainer's
    loss = ((logp * weights[:, : logp.shape[1]]).sum() + 0.1 * entropy.sum()) / tokens
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.compares_runs
def test_loss_and_gradients_equal_padded():
    """Gradients through the shared prompt are the sum over its group, as in the padded layout."""
    batch = _groups_batch(2)
    model = _model(seed=3)
    weights = torch.randn(batch.labels.shape, generator=torch.Generator().manual_seed(0)) * batch.mask
    want_loss, want = _loss_and_grads(model, _part(None, batch), weights)
    got_loss, got = _loss_and_grads(model, _part(_shared(), batch), weights)
    run_guard.assert_gradient_flows(want, what="the padded layout's gradients")
    run_guard.assert_gradient_flows(got, what="the shared layout's gradients")
    assert abs(float(got_loss - want_loss)) <= fp32_result(abs(float(want_loss))).atol
    _assert_same(want, got)


def _completions_see_each_other(monkeypatch):
    real = share_prompt.shared_mask
    monkeypatch.setattr(share_prompt, "shared_mask", lambda seg, sub, dtype: real(seg, torch.zeros_like(sub), dtype))


def _positions_run_on(monkeypatch):  # positions counted along the row (each completion after the previous one)
    import portarl.trainer.phases.packing as packing

    real = packing.Packed.forward_kwargs

    def run_on(self):
        kwargs = real(self)
        if self.attention_mask is not None:
            pos = kwargs["position_ids"]
            index = torch.arange(pos.shape[1]).expand_as(pos)
            unit_start = torch.where(pos == 0, index, torch.zeros_like(index)).cummax(dim=1).values
            kwargs["position_ids"] = index - unit_start
        return kwargs

    monkeypatch.setattr(packing.Packed, "forward_kwargs", run_on)


@pytest.mark.parametrize(("fault", "dtype"), [(_completions_see_each_other, torch.float32),
                                              (_completions_see_each_other, torch.bfloat16),
                                              (_positions_run_on, torch.float32)],
                         ids=["leak-fp32", "leak-bf16", "positions-fp32"])
def test_a_wrong_mask_or_positions_is_caught(monkeypatch, fault, dtype):
    model, batch = _model(dtype), _groups_batch()
    _assert_shared_equal_padded(model, batch, _shared(), dtype)
    fault(monkeypatch)
    with pytest.raises(AssertionError, match="logp"):
        _assert_shared_equal_padded(model, batch, _shared(), dtype)


def test_groups_with_long_completions_are_not_shared_where_that_costs_more():
    """A dense mask computes every query-key pair of a row: two samples of 40 tokens after a
    2-token prompt stay two rows (sharing would save 2 tokens and quadruple the attention)."""
    batch = build_batch([[5, 6]] * 2, [[7] * 40, [8] * 40], 0, "cpu")
    attention_bound = dataclasses.replace(_shared(), linear=1, attention=100)
    assert int((_part(attention_bound, batch).packed.input_ids == 5).sum()) == 2  # the prompt twice
    linear_bound = dataclasses.replace(_shared(), linear=100, attention=0)
    assert int((_part(linear_bound, batch).packed.input_ids == 5).sum()) == 1  # the prompt once


def _cfg(**train):
    from portarl.trainer.config import TrainConfig

    cfg = TrainConfig()
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def test_auto_on_where_supported_true_refused_elsewhere():
    from portarl.trainer.phases.packing import resolve_padding_free

    assert resolve_padding_free(_cfg(), _model()).share_prompt
    eager = resolve_padding_free(_cfg(), _model(torch.bfloat16, "eager"))
    assert eager.share_prompt and eager.mask_dtype == torch.bfloat16
    assert not resolve_padding_free(_cfg(share_prompt=False), _model()).share_prompt
    assert resolve_padding_free(_cfg(padding_free=False), _model()) is None
    with pytest.raises(ConfigError, match="train.share_prompt=true"):
        resolve_padding_free(_cfg(padding_free=False, share_prompt=True), _model())
    flash = _model(impl="flash_attention_2")
    assert not resolve_padding_free(_cfg(), flash).share_prompt
    with pytest.raises(ConfigError, match="train.share_prompt=true.*flash_attention_2"):
        resolve_padding_free(_cfg(share_prompt=True), flash)
    with pytest.raises(ConfigError, match="train.share_prompt"):
        _cfg(share_prompt="yes").validate()


def _spy_shared(monkeypatch) -> list[bool]:
    """Whether each packed micro-batch used shared-prompt rows."""
    import portarl.trainer.phases.micro_batches as mb

    seen: list[bool] = []
    real = mb.pack_micro_batch

    def spy(*args):
        out = real(*args)
        seen.append(out.attention_mask is not None)
        return out

    monkeypatch.setattr(mb, "pack_micro_batch", spy)
    return seen


@pytest.mark.compares_runs
@STEP_SETTINGS
def test_step_gradients_equal_padded(tmp_path, monkeypatch, setting):
    if "model.lora.r=4" in setting:
        pytest.importorskip("peft")
    seen = _spy_shared(monkeypatch)
    padded, _ = _gradients(tmp_path, monkeypatch, "train.padding_free=false", *setting, name="padded")
    assert not seen
    shared, trainer = _gradients(tmp_path, monkeypatch, "train.share_prompt=true", *setting, name="shared")
    assert trainer.padding_free.share_prompt and any(seen)
    run_guard.assert_gradient_flows(padded, what=f"the padded step's gradients ({setting})")
    run_guard.assert_gradient_flows(shared, what=f"the shared-prompt step's gradients ({setting})")
    _assert_same(padded, shared)


@pytest.mark.compares_runs
def test_step_with_reference_equal_unshared(make_trainer, monkeypatch):
    """A whole step (KL to a reference copy, old log-probs recomputed, entropy): every
    metric and the updated weights, shared vs unshared rows, within fp32 tolerance."""
    seen = _spy_shared(monkeypatch)
    want, got = (step_with_reference(make_trainer, f"train.share_prompt={value}") for value in ("false", "true"))
    assert any(seen) and not all(seen)  # the unshared run, then the shared one
    assert_steps_equal(want, got)
