"""Routing replay R2 (issue 48, ``rollout.routing_replay: old``): the trainer's old
log-prob forward records each token's experts and every update forward of the batch routes
by them, even after the policy (its routers included) moved between mini-batches.

Each test step here runs ``train.mini_batches=2``, and after the first optimizer step the
routers are negated (their own top-k becomes the experts they liked least), so the second
mini-batch's forwards would route otherwise by themselves. The check keys every forward's
tokens by their sequence's content and position, so it holds in any micro-batch layout:
every update forward routes each recorded token as the old forward did. With the recorded
experts ignored, the same check fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import run_guard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

from portarl.moe import routing  # noqa: E402
from portarl.moe.models import BUILTIN_MOES, build_tiny_moe  # noqa: E402
from portarl.trainer import GRPOTrainer  # noqa: E402
from portarl.trainer.phases import scoring, update  # noqa: E402
from portarl.assets.data import arithmetic_examples  # noqa: E402
from trainer_fast import fast_config, varied_reward  # noqa: E402

LAYOUTS = {"padded": ["train.padding_free=false"],
           "padding-free": ["train.padding_free=true", "train.share_prompt=false"],
           "shared-prompt": ["train.padding_free=true", "train.share_prompt=true"]}


def _trainer(tmp_path, name, *overrides):
    model, tokenizer = build_tiny_moe(name, seed=3)
    cfg = fast_config(tmp_path, "rollout.routing_replay=old", "train.steps=1", "rollout.max_new_tokens=6",
                      "train.mini_batches=2", "train.micro_batch_size=4", "loss.kl_coef=0.01", *overrides)
    return GRPOTrainer(model, tokenizer, [varied_reward], arithmetic_examples(16, seed=0), cfg, device="cpu")


def _tokens(part, chosen: list[torch.Tensor]) -> dict:
    """{(prompt or sequence, position): experts per layer} for the fed tokens (the prompt, the
    completion but its last token) that ``part``'s forward computed; ``chosen`` per layer
    [N, k] in the forward's token order (padded, or packed by ``part.packed.source``)."""
    rows, width = part.input_ids.shape
    flat = [c.sort(-1).values for c in chosen]
    if part.packed is None:
        grid, got = [f.view(rows, width, -1) for f in flat], torch.ones(rows, width, dtype=torch.bool)
    else:
        real = part.packed.real()
        source = part.packed.source[real]
        grid, got = [], torch.zeros(rows * width, dtype=torch.bool)
        got[source] = True
        for f in flat:
            g = torch.zeros(rows * width, f.shape[-1], dtype=f.dtype)
            g[source] = f[real]
            grid.append(g.view(rows, width, -1))
        got = got.view(rows, width)
    out = {}
    prompt_lens = part.attention_mask[:, : part.prompt_width].sum(-1).tolist()
    for r in range(rows):
        cols = part.attention_mask[r].nonzero().flatten().tolist()
        tokens = tuple(part.input_ids[r, cols].tolist())
        for j, col in enumerate(cols[: max(prompt_lens[r], len(cols) - 1)]):
            if got[r, col]:  # a prompt token is its prompt's (a group's rows share it), a completion token its row's
                key = (tokens[: prompt_lens[r]], j) if j < prompt_lens[r] else (tokens, j)
                out[key] = tuple(tuple(g[r, col].tolist()) for g in grid)
    return out


def _run(trainer):
    """One step; returns (old forwards' tokens, update forwards' tokens per optimizer step,
    whether the reference routed by itself, the step's metrics)."""
    found = routing.routers(trainer.model)
    chosen: list = []
    handles = [r.register_forward_hook(lambda m, a, out, i=i: chosen.append((i, out[2].detach()))) for i, r in
               enumerate(found)]
    old: dict = {}
    updates: list[dict] = [{}]
    ref_own = []

    real_scoring, real_update, real_step = scoring.logprobs, update.logprobs, update.optimizer_step

    def scoring_logprobs(trainer_, model, part, **kw):
        chosen.clear()  # (a deep copy, the KL reference, has the hooks too)
        out = real_scoring(trainer_, model, part, **kw)
        if model is trainer.model:
            forward(part, model, old)
        else:  # the KL reference: its own router's choice, nothing given
            ref_own.append(all(r._portarl_routing.given is None for r in routing.routers(model)))
        return out

    def update_logprobs(trainer_, model, part, **kw):
        chosen.clear()
        out = real_update(trainer_, model, part, **kw)
        forward(part, model, updates[-1])
        return out

    def step_then_move_the_routers(*args, **kwargs):
        result = real_step(*args, **kwargs)
        with torch.no_grad():
            for r in found:
                r.weight.mul_(-1.0)  # the routers' own top-k is now the experts they liked least
        updates.append({})
        return result

    def forward(part, model, into):  # this forward's records (one per router, in layer order), keyed by token
        assert sorted(i for i, _ in chosen) == list(range(len(found))), "one call per router per forward"
        into.update(_tokens(part, [c for _, c in sorted(chosen, key=lambda t: t[0])]))
        chosen.clear()

    with pytest.MonkeyPatch.context() as m:
        m.setattr(scoring, "logprobs", scoring_logprobs)
        m.setattr(update, "logprobs", update_logprobs)
        m.setattr(update, "optimizer_step", step_then_move_the_routers)
        try:
            metrics = trainer.train_step()
        finally:
            for h in handles:
                h.remove()
            trainer.close()
    return old, [u for u in updates if u], ref_own, metrics


def _differing(old: dict, update_tokens: dict) -> tuple[int, int]:
    common = [k for k in update_tokens if k in old]
    return sum(update_tokens[k] != old[k] for k in common), len(common)


@pytest.mark.compares_runs
@pytest.mark.parametrize("name", list(BUILTIN_MOES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_update_forward_routes_as_the_old_policy_did(tmp_path, name, layout):
    trainer = _trainer(tmp_path, name, *LAYOUTS[layout])
    negated = {id(r.weight) for r in routing.routers(trainer.model)}  # moved by _run, not by training
    trained = {n: p for n, p in trainer.model.named_parameters() if id(p) not in negated}
    start = {n: p.detach().clone() for n, p in trained.items()}
    old, updates, ref_own, metrics = _run(trainer)
    # the policy moved by training too, not only by the routers negated between the optimizer steps
    run_guard.assert_trained([metrics["grad_norm"]], start, trained, what=f"{name} {layout}")
    assert len(updates) == 2, "two optimizer steps (train.mini_batches=2)"
    for k, tokens in enumerate(updates):
        differ, compared = _differing(old, tokens)
        assert compared > 0.5 * len(tokens), (k, compared, len(tokens))
        assert differ == 0, f"optimizer step {k + 1}: {differ} of {compared} tokens routed otherwise than the old forward"
    assert ref_own and all(ref_own), "the KL reference routes by its own router under R2"
    # the second mini-batch's routers would have chosen otherwise (they were negated)
    assert 0.0 < metrics["rollout/routing_agreement"] < 0.9, metrics["rollout/routing_agreement"]


def test_ignoring_the_recording_routes_the_moved_policy_otherwise(tmp_path, monkeypatch):
    """The check above can fail: with the replay switched off, the second optimizer step's
    forwards route by the negated routers."""
    monkeypatch.setattr(routing, "set_replay", lambda *args, **kwargs: None)
    old, updates, _, _ = _run(_trainer(tmp_path, "tiny-qwen3-moe"))
    differ, compared = _differing(old, updates[1])
    assert compared and differ > 0.5 * compared, (differ, compared)


def test_one_optimizer_step_the_update_forward_is_the_old_policys(tmp_path):
    """The on-policy shortcut (old log-probs = the training forward's, detached): that
    forward is the batch's first and only one, nothing is recorded nor replayed, and the
    agreement is 1 by definition."""
    recorded = []
    real = scoring.no_grad_logprobs
    trainer = _trainer(tmp_path, "tiny-qwen3-moe", "train.mini_batches=1", "loss.kl_coef=0")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(scoring, "no_grad_logprobs", lambda *a, **k: recorded.append(1) or real(*a, **k))
        try:
            metrics = trainer.train_step()
        finally:
            trainer.close()
    assert recorded == [] and metrics["rollout/routing_agreement"] == 1.0
    assert metrics["grad_norm"] > 0


def test_r2_on_a_dense_model_is_refused_naming_the_setting(tmp_path):
    from portarl.trainer import build_from_config
    from portarl.trainer.config.fields import ConfigError

    cfg = fast_config(tmp_path, "rollout.routing_replay=old", "train.steps=1")
    model, tokenizer, examples = build_from_config(cfg)
    with pytest.raises(ConfigError, match="rollout.routing_replay=old: the model has no mixture-of-experts routers"):
        GRPOTrainer(model, tokenizer, [varied_reward], examples, cfg, device="cpu")
    with pytest.raises(ValueError, match="rollout.routing_replay"):
        fast_config(tmp_path, "rollout.routing_replay=bogus").validate()
