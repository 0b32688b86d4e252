"""KL coefficient controllers (Ziegler et al. 2019, "Fine-Tuning Language Models from
Human Preferences", section 2.2; the same rule as verl's ``AdaptiveKLController``).

Adaptive: after each iteration with measured KL ``kl`` over ``n`` sequences,

    error = clip(kl / target - 1, -0.2, 0.2)
    coef  = coef * (1 + error * n / horizon)

so the coefficient grows while the policy drifts further from the reference than the
target and shrinks while it stays closer; the clip bounds the change per iteration.
"""

from __future__ import annotations

import math


class FixedKLController:
    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, kl: float, n: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    def __init__(self, coef: float, target: float, horizon: int):
        if not (coef > 0 and target > 0 and horizon > 0):
            raise ValueError(f"AdaptiveKLController needs coef, target, horizon > 0, got {coef}, {target}, {horizon}")
        super().__init__(coef)
        self.target, self.horizon = float(target), int(horizon)

    def update(self, kl: float, n: int) -> None:
        """A non-finite ``kl`` (a skipped iteration) leaves the coefficient as it is."""
        if not math.isfinite(kl):
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n / self.horizon


def make_kl_controller(config) -> FixedKLController:
    """From a :class:`~portarl.core.GRPOConfig`: adaptive when ``kl_target`` is set."""
    if config.kl_target is None:
        return FixedKLController(config.kl_coef)
    return AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
