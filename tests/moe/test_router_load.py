"""Expert load and the router load-balancing loss (issue 48): ``loss.router_aux_coef`` 0
leaves the step's loss and gradients bit-identical to a step without the router hooks;
> 0 changes the router's gradient, and ``moe/aux_loss`` is transformers' function on the
training forward's router logits over its real tokens; ``moe/load_imbalance`` is a hand
count of the routed experts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import run_guard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

from portarl.assets.data import arithmetic_examples  # noqa: E402
from portarl.moe import routing  # noqa: E402
from portarl.moe.load import RouterTap, real_tokens  # noqa: E402
from portarl.moe.models import build_tiny_moe  # noqa: E402
from portarl.trainer import GRPOTrainer  # noqa: E402
from portarl.trainer.config import ConfigError  # noqa: E402
from portarl.trainer.phases import update  # noqa: E402
from trainer_fast import fast_config, varied_reward  # noqa: E402


def _step(tmp_path, monkeypatch, *overrides, tap: bool = True, spy=None):
    """One training step of tiny-qwen3-moe; returns (metrics, gradients by name before the
    optimizer applies them, the training forwards' micro-batches)."""
    model, tokenizer = build_tiny_moe("tiny-qwen3-moe", seed=3)
    cfg = fast_config(tmp_path, "train.steps=1", "rollout.max_new_tokens=6", "train.padding_free=false", *overrides)
    trainer = GRPOTrainer(model, tokenizer, [varied_reward], arithmetic_examples(16, seed=0), cfg, device="cpu")
    grads, parts = {}, []
    if not tap:
        monkeypatch.setattr(update, "router_tap", lambda trainer, coef: None)  # the step as before the hooks
    apply, logprobs = update.guarded_optimizer_step, update.logprobs

    def record_grads(trainer_):
        grads.update({n: p.grad.clone() for n, p in trainer_.model.named_parameters() if p.grad is not None})
        return apply(trainer_)

    def record_parts(trainer_, model_, part, **kwargs):
        parts.append(part)
        return logprobs(trainer_, model_, part, **kwargs)

    monkeypatch.setattr(update, "guarded_optimizer_step", record_grads)
    monkeypatch.setattr(update, "logprobs", record_parts)
    if spy is not None:
        spy(trainer.model)
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
        monkeypatch.undo()
    return metrics, grads, parts


@pytest.mark.compares_runs
def test_coef_zero_leaves_loss_and_gradients_bit_identical(tmp_path, monkeypatch):
    with_tap, grads, _ = _step(tmp_path / "a", monkeypatch)
    without, grads_before, _ = _step(tmp_path / "b", monkeypatch, tap=False)
    run_guard.assert_gradient_flows(grads_before, what="the step without the router hooks")
    run_guard.assert_gradient_flows(grads, what="the step with the router hooks")
    assert "moe/load_imbalance" in with_tap and "moe/load_imbalance" not in without
    assert "moe/aux_loss" not in with_tap
    assert with_tap["loss"] == without["loss"] and with_tap["grad_norm"] == without["grad_norm"]
    assert grads.keys() == grads_before.keys() and grads
    assert all(torch.equal(grads[n], grads_before[n]) for n in grads)


@pytest.mark.compares_runs
def test_aux_loss_is_transformers_function_and_moves_the_router(tmp_path, monkeypatch):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits: list = []

    def spy(model):  # the training forward's router logits (the only forward with gradients)
        for router in routing.routers(model):
            router.register_forward_hook(lambda m, a, out: logits.append(out[0].detach())
                                         if torch.is_grad_enabled() else None)

    coef = 0.5
    metrics, grads, parts = _step(tmp_path / "a", monkeypatch, f"loss.router_aux_coef={coef}",
                                  "train.micro_batch_size=64", spy=spy)
    _, grads_off, _ = _step(tmp_path / "b", monkeypatch)
    run_guard.assert_gradient_flows(grads_off, what="the step without the aux loss")
    assert len(parts) == 1 and len(logits) == 2  # one micro-batch, two MoE layers
    expected = load_balancing_loss_func(tuple(logits), 4, 2, parts[0].attention_mask)
    assert metrics["moe/aux_loss"] == float(expected.float())
    assert metrics["moe/aux_loss"] >= 1.0  # the loss is >= 1, 1 only when balanced
    routers = [n for n in grads if n.endswith("mlp.gate.weight")]
    assert len(routers) == 2 and all(not torch.equal(grads[n], grads_off[n]) for n in routers)


def test_load_imbalance_is_a_hand_count_over_real_tokens():
    model, _ = build_tiny_moe("tiny-qwen3-moe", seed=1)
    ids = torch.randint(3, 70, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with RouterTap(model) as tap, torch.no_grad():
        tap.reset(aux=False)
        with tap.forward():
            model.get_decoder()(input_ids=ids, attention_mask=mask)
        tap.count(mask.reshape(-1).bool())
    with routing.recording(model) as calls, torch.no_grad():
        model.get_decoder()(input_ids=ids, attention_mask=mask)
    hand = torch.zeros(2, 4)
    for layer, (chosen,) in enumerate(calls):
        for token, experts in enumerate(chosen.tolist()):
            if mask.reshape(-1)[token]:
                for e in experts:
                    hand[layer, e] += 1
    assert torch.equal(tap.counts, hand) and hand.sum() == 2 * 10 * 2  # 2 layers, 10 real tokens, k = 2
    shares = hand.max(-1).values / hand.mean(-1)
    assert torch.equal(tap.imbalance(), shares.max())


def test_packed_real_tokens_are_the_sequences_tokens():
    """A packed row's unused tail is not a token (its ``source`` points at a padded slot 0)."""
    from portarl.trainer.phases.packing import Layout, pack_micro_batch
    from portarl.trainer.phases.sequences import build_batch

    prompts, completions = [[5, 6, 7, 8, 9, 10]] * 2 + [[11]], [[12], [13, 14], [15, 16, 17]]
    batch = build_batch(prompts, completions, 0, "cpu")
    shared = False
    tails = 0
    for layout in (Layout("rows", longest_only=True), Layout("rows", attention=1, share_prompt=True),
                   Layout("varlen")):
        batch.packed = pack_micro_batch(batch, [6, 6, 1], [1, 2, 3], layout, keys=[tuple(p) for p in prompts])
        shared |= batch.packed.attention_mask is not None
        real = real_tokens(batch)
        assert torch.equal(real, batch.packed.real()) and real.numel() == batch.packed.input_ids.numel()
        source = batch.packed.source[real].tolist()
        padded_real = set(batch.attention_mask.reshape(-1).nonzero().reshape(-1).tolist())
        assert len(set(source)) == len(source) and set(source) <= padded_real  # each a sequence's token, once
        if batch.packed.attention_mask is None:  # unshared: every token of every sequence
            assert set(source) == padded_real
        tails += int((~real).sum())  # rows' unused tails, left out
    assert shared and tails  # the shared-prompt layout was taken; a layout had tails


def test_the_coefficient_is_validated_and_refused_for_a_dense_model(tmp_path):
    with pytest.raises(ConfigError, match="loss.router_aux_coef"):
        fast_config(tmp_path, "loss.router_aux_coef=-1")
    from portarl.assets.models import build_tiny

    model, tokenizer = build_tiny()
    cfg = fast_config(tmp_path, "loss.router_aux_coef=0.1")
    with pytest.raises(ConfigError, match="loss.router_aux_coef=0.1 needs a mixture-of-experts model"):
        GRPOTrainer(model, tokenizer, [varied_reward], arithmetic_examples(4, seed=0), cfg, device="cpu")
