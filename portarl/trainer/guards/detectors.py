"""Stability guards: non-finite checks, spike detectors, degenerate-output detector.

Each guard returns what it saw so the trainer can put it in the metrics and log a line
when it fires; none of them changes numbers by itself.
"""

from __future__ import annotations

import collections
import statistics

import torch


class GuardTripped(FloatingPointError):
    """A guard refuses the optimizer step; ``tensor_name`` names what it saw."""

    def __init__(self, tensor_name: str, message: str):
        self.tensor_name = tensor_name
        super().__init__(message)


class NonFiniteError(GuardTripped):
    """A named tensor of the pipeline holds NaN or inf: the step must be skipped."""

    def __init__(self, tensor_name: str, detail: str = ""):
        super().__init__(tensor_name, f"non-finite {tensor_name}" + (f" ({detail})" if detail else ""))


class SpikeTripped(GuardTripped):
    """A spike detector with action ``skip`` or ``stop`` refused the optimizer step."""


def check_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise :class:`NonFiniteError` naming ``name`` if ``tensor`` (where ``mask``) is not finite."""
    values = tensor.detach()
    bad = ~torch.isfinite(values)
    if mask is not None:
        bad = bad & mask.bool()
    count = int(bad.sum())
    if count:
        raise NonFiniteError(name, f"{count} of {int(mask.sum()) if mask is not None else values.numel()} values")


def first_nonfinite_gradient(model: torch.nn.Module) -> str | None:
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is not None and hasattr(grad, "to_local"):  # FSDP2 DTensor: this rank's shard
            grad = grad.to_local()
        if grad is not None and not bool(torch.isfinite(grad).all()):
            return name
    return None


class SpikeDetector:
    """Flags a value above a fixed ``ceiling`` (from the first value on: the warm-up has
    no history to compare with, and an exploding first step must not pass), or, once
    ``min_history`` values are in, above both median + factor * MAD of the last ``window``
    values and ``ratio`` x that median (robust to the slow drift and the step-to-step noise
    of a training curve, sensitive to a jump: a default fp32 demo run's grad norm and KL
    wander within 2.5x their median, the failures this exists for jump 10x). A value at
    or below ``floor`` is never a relative spike: from a near-zero history (a KL that starts
    at exactly 0, steps without learning signal) any real value would look like a jump.
    Non-finite values are not added to the history."""

    def __init__(self, name: str, window: int = 20, min_history: int = 5, factor: float = 6.0,
                 ceiling: float | None = None, floor: float = 0.0, ratio: float = 1.0):
        self.name, self.factor, self.min_history, self.ceiling = name, factor, min_history, ceiling
        self.floor, self.ratio = floor, ratio
        self.history: collections.deque[float] = collections.deque(maxlen=window)

    def update(self, value: float) -> dict | None:
        event = None
        if self.ceiling is not None and value > self.ceiling:
            event = {"kind": f"{self.name}_spike", "value": value, "threshold": self.ceiling, "reason": "ceiling",
                     "median": float("nan"), "mad": float("nan")}
        elif len(self.history) >= self.min_history and value == value and value > self.floor:
            med = statistics.median(self.history)
            mad = statistics.median(abs(v - med) for v in self.history)
            threshold = max(med + self.factor * max(mad, 1e-8 + 1e-3 * abs(med)), self.ratio * med)
            if value > threshold:
                event = {"kind": f"{self.name}_spike", "value": value, "median": med, "mad": mad, "threshold": threshold,
                         "reason": "relative"}
        if value == value and abs(value) != float("inf"):
            self.history.append(value)
        return event

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(state["history"])


def is_degenerate(completion: list[int], eos_token_id: int, min_tokens: int) -> bool:
    """One token repeated (like "!!!!!!!!"), at least ``min_tokens`` long (eos not counted)."""
    tokens = [t for t in completion if t != eos_token_id]
    return len(tokens) >= min_tokens and len(set(tokens)) == 1


class DegenerateDetector:
    """Fraction of degenerate completions per batch, and an event on a sharp rise."""

    def __init__(self, eos_token_id: int, min_tokens: int = 4, rise: float = 0.25, window: int = 20):
        self.eos_token_id, self.min_tokens, self.rise = eos_token_id, min_tokens, rise
        self.history: collections.deque[float] = collections.deque(maxlen=window)

    def update(self, completions: list[list[int]]) -> tuple[float, dict | None]:
        frac = sum(is_degenerate(c, self.eos_token_id, self.min_tokens) for c in completions) / max(1, len(completions))
        baseline = statistics.median(self.history) if self.history else 0.0
        event = None
        if frac - baseline >= self.rise:
            event = {"kind": "degenerate_rise", "value": frac, "median": baseline}
        self.history.append(frac)
        return frac, event

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(state["history"])
