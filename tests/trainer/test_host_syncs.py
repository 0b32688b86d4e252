"""Host syncs of the update: one transfer per optimizer step (metrics, guard flags, grad
norm), however many micro-batches; value checks (labels, loss normalisers) that block only
on CPU or with PORTARL_DEBUG_CHECKS=1."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import portarl.trainer.phases.iteration as grpo
import portarl.trainer.phases.update as update
from portarl import ops
from portarl.ops import _checks
from trainer_fast import varied_reward


REAL_TO_HOST = update._to_host


class ScalarSyncs(TorchDispatchMode):
    """Counts tensor -> Python scalar reads (``item``, ``float``, ``int``, ``bool``: each is
    ``aten._local_scalar_dense``, a blocking sync on an accelerator) made by portarl code
    (the innermost caller outside torch is in portarl; transformers' own mask check is not
    ours to remove)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = traceback.extract_stack()[:-1]  # without this method's own frame
            caller = next((f.filename for f in reversed(frames) if "/torch/" not in f.filename), "")
            self.count += "/portarl/" in caller and "/tests/" not in caller
        return func(*args, **(kwargs or {}))


def _update_syncs(make_trainer, monkeypatch, *overrides) -> tuple[int, int]:
    """(scalar syncs, _to_host calls) in the update phase of one iteration, with the
    accelerator policy for value checks (device asserts) forced on this CPU."""
    monkeypatch.setattr(_checks, "eager_checks", lambda device: False)
    trainer = make_trainer(*overrides, "loss.kl_coef=0.01", rewards=[varied_reward])
    transfers = []
    real_to_host, real_update = REAL_TO_HOST, update.run_update
    monkeypatch.setattr(update, "_to_host", lambda values: transfers.append(1) or real_to_host(values))
    mode = ScalarSyncs()

    def counted(*args, **kwargs):
        with mode:
            return real_update(*args, **kwargs)

    monkeypatch.setattr(grpo, "run_update", counted)
    metrics = trainer.train_step()
    assert metrics["skipped"] == 0
    return mode.count, len(transfers)


@pytest.mark.parametrize("old", ["auto", "recompute"])
def test_update_syncs_do_not_grow_with_micro_batches(make_trainer, monkeypatch, old):
    one, transfers_one = _update_syncs(make_trainer, monkeypatch, "train.micro_batch_size=16",
                                       f"train.old_logprobs={old}")
    four, transfers_four = _update_syncs(make_trainer, monkeypatch, "train.micro_batch_size=4",
                                         f"train.old_logprobs={old}")
    assert transfers_one == transfers_four == 1  # one optimizer step, one transfer
    assert four == one, f"{four} scalar syncs with 4 micro-batches vs {one} with 1: a per-micro-batch sync"


def test_one_transfer_per_optimizer_step(make_trainer, monkeypatch):
    _, transfers = _update_syncs(make_trainer, monkeypatch, "train.mini_batches=2", "train.ppo_epochs=2")
    assert transfers == 4


def test_label_check_is_eager_on_cpu_and_in_debug_mode(monkeypatch):
    monkeypatch.delenv(_checks.DEBUG_CHECKS_ENV, raising=False)
    assert _checks.eager_checks(torch.device("cpu"))
    assert not _checks.eager_checks(torch.device("cuda"))
    monkeypatch.setenv(_checks.DEBUG_CHECKS_ENV, "1")
    assert _checks.eager_checks(torch.device("cuda"))


def test_label_check_on_accelerators_is_a_device_assert(monkeypatch):
    logits = torch.randn(2, 3, 5)
    good, bad = torch.tensor([[0, 4, -100], [1, 2, 3]]), torch.tensor([[0, 5, -100], [1, 2, 7]])
    with pytest.raises(ValueError, match=r"labels: 2 value\(s\) outside \[0, 5\).*first: 5"):
        ops.logprobs(logits, bad)  # CPU: eager, exact
    monkeypatch.setattr(_checks, "eager_checks", lambda device: False)  # what cuda / npu get
    mode = ScalarSyncs()
    with mode:
        _checks.check_labels(good, 5, -100)
    assert mode.count == 0
    # On CPU the device assert fires at once; on an accelerator at the next sync.
    with pytest.raises(RuntimeError, match="labels: value.*outside \\[0, 5\\).*PORTARL_DEBUG_CHECKS=1"):
        _checks.check_labels(bad, 5, -100)


def _poison_grad_of(trainer, index: int, value: float) -> str:
    """A non-finite gradient in one parameter (not the first) during the next backward."""
    name, param = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad][index]
    param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), value))
    return name


def test_nonfinite_gradient_names_its_parameter(make_trainer):
    """Finiteness comes from the grad norm; the parameter is searched for only then, and named."""
    trainer = make_trainer(rewards=[varied_reward])
    name = _poison_grad_of(trainer, 3, float("nan"))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step()
    assert metrics["skipped"] == 1 and metrics["guard/nonfinite_tensor"] == "gradient"
    message = next(msg for kind, msg, _ in metrics["_events"] if kind == "skipped_step")
    assert f"parameter {name})" in message, message
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_fp16_overflow_lowers_the_scale_and_skips_the_update(make_trainer):
    trainer = make_trainer("precision.dtype=fp16", rewards=[varied_reward])
    scale = trainer.precision.scale
    _poison_grad_of(trainer, 3, float("inf"))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step()
    assert metrics["precision/overflow"] == 1.0 and metrics["skipped"] == 0
    assert trainer.precision.scale == metrics["precision/loss_scale"] == scale / 2
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert not trainer.optimizer.state  # AdamW never stepped
