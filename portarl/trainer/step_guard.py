"""The trainer's guards in one place: which tensors are checked, in what order, how ranks
agree on a failure, how a skipped iteration is counted, and the spike judgment.

Order of the checks in an iteration (the first failure names the step's bad tensor):
``logits`` (blamed when old log-probs are non-finite because the model itself produced
NaN/inf), ``reward``, ``old_logp``, ``ref_logp``, ``advantage``, ``loss``, ``gradient``.

Primitives (``check_finite``, the detectors) live in :mod:`portarl.trainer.guards`.
"""

from __future__ import annotations

import torch

from portarl import distributed as pdist
from portarl.trainer.guards import NonFiniteError, check_finite
from portarl.trainer.sequences import nonfinite_logit_positions

GUARD_ORDER = ("logits", "reward", "old_logp", "ref_logp", "advantage", "loss", "gradient")


class StepGuard:
    """Non-finite checks for one iteration. Single process: a failure raises at once.
    Several ranks: a failure is only recorded, and every rank learns of it at the next
    :meth:`sync` (they must all reach the same collectives)."""

    def __init__(self, dist):
        self.dist = dist
        self.pending: str | None = None

    def reset(self) -> None:
        self.pending = None

    def record(self, name: str) -> None:
        if self.pending is None:
            self.pending = name

    def check(self, name: str, tensor: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        if not self.dist.enabled:
            check_finite(name, tensor, mask)
            return
        try:
            check_finite(name, tensor, mask)
        except NonFiniteError:
            self.record(name)

    def sync(self) -> None:
        if not self.dist.enabled:
            return
        none = len(GUARD_ORDER)
        code = GUARD_ORDER.index(self.pending) if self.pending else none
        self.pending = None
        first = pdist.first_code(self.dist, code)
        if first < none:
            raise NonFiniteError(GUARD_ORDER[first], "on at least one rank; every rank skips")

    def blame_logits(self, trainer, batch, logp: torch.Tensor) -> None:
        """When log-probs are non-finite, name the logits if they are the source (the model
        itself produced NaN/inf: overflow in the forward, corrupted weights)."""
        if self.dist.enabled:
            return  # an extra forward on one rank only would break FSDP's collectives
        rows = torch.nonzero((~torch.isfinite(logp) & batch.mask).any(dim=-1)).flatten()
        bad = nonfinite_logit_positions(trainer.model, batch.rows(rows), trainer.config.precision.logits)
        if bool(bad.any()):
            raise NonFiniteError("logits", f"{int(bad.sum())} positions in {rows.numel()} sequences")


def record_skip(trainer, err: NonFiniteError, metrics: dict, events: list) -> None:
    """The iteration was skipped before its optimizer step: count it, name the tensor."""
    trainer.precision.zero_grad()
    trainer.skipped_total += 1
    trainer.consecutive_skips += 1
    if trainer.consecutive_skips == 1:
        trainer.streak_first_bad = err.tensor_name
    metrics["guard/nonfinite_tensor"] = err.tensor_name
    events.append(("skipped_step", f"skipped the optimizer step: {err}; weights and optimizer state untouched", {}))


def record_clean(trainer) -> None:
    trainer.consecutive_skips = 0
    trainer.streak_first_bad = None


def finish_metrics(trainer, metrics: dict, events: list, skipped: bool, overflow: bool) -> None:
    """Skip counters, lr, kl, and the spike detectors (fed only by clean steps)."""
    cfg = trainer.config
    metrics["skipped"] = int(skipped)
    metrics["guard/skipped_total"] = trainer.skipped_total
    metrics["guard/consecutive_skips"] = trainer.consecutive_skips
    metrics["lr"] = trainer.scheduler.get_last_lr()[0]
    kl = metrics.get("kl/value", metrics.get("pg/approx_kl", float("nan")))
    metrics["kl"] = kl
    metrics.setdefault("grad_norm", float("nan"))
    spike = 0
    if not skipped and not overflow:
        for detector, value in ((trainer.kl_spikes, kl), (trainer.grad_spikes, metrics["grad_norm"])):
            event = detector.update(value)
            if event:
                spike = 1
                events.append((event["kind"], f"{detector.name} spike: {value:.4g} > median {event['median']:.4g} + "
                               f"{cfg.guards.spike_factor:g} x MAD {event['mad']:.3g}", event))
    metrics["guard/spike"] = spike
