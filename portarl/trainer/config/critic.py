"""The ``critic`` section: the value model of ``loss.advantage_estimator: gae`` (PPO with a
critic; :mod:`portarl.core.gae`, :mod:`portarl.trainer.phases.critic`)."""

from __future__ import annotations

import dataclasses

from portarl.trainer.config.fields import _check, _number, _positive_int


@dataclasses.dataclass
class CriticConfig:
    #: Where the value model starts: "policy" (the policy's architecture and weights, its
    #: output head replaced by a scalar value head initialised to 0), or a reward model's
    #: directory (its backbone and its score head; portarl's built-in ones included).
    init: str = "policy"
    #: AdamW learning rate of the value model (null: optim.lr). verl's critic.optim.lr is 1e-5.
    lr: float | None = None
    #: Value-only steps before the policy updates (verl trainer.critic_warmup counts from 1 and
    #: gives N - 1 of them; slime --num-critic-only-steps N gives N, as here): the policy's
    #: weights and optimizer do not move during them.
    warmup_steps: int = 0
    #: Value clipping: the value loss is max((V - R)^2, (clip(V, V_old +- c) - R)^2) / 2
    #: (verl critic.cliprange_value 0.5); null: unclipped.
    cliprange_value: float | None = 0.5
    #: GAE discount gamma and lambda (verl's defaults, 1.0 each: the Monte Carlo return).
    gamma: float = 1.0
    lam: float = 1.0
    #: AdamW decoupled weight decay and gradient-norm clip of the value model.
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0

    def validate(self):
        _check(isinstance(self.init, str) and bool(self.init), "critic.init",
               "must be 'policy' or a reward model's directory", self.init)
        _number(self, "critic", "lr", low=0.0, allow_none=True)
        _positive_int(self, "critic", "warmup_steps", allow_zero=True)
        _number(self, "critic", "cliprange_value", low=0.0, allow_none=True)
        _number(self, "critic", "weight_decay", low=0.0, strict=False)
        _number(self, "critic", "grad_clip", low=0.0, allow_none=True)
        for name in ("gamma", "lam"):
            _number(self, "critic", name, low=0.0, strict=False)
            _check(0.0 <= getattr(self, name) <= 1.0, f"critic.{name}", "must be in [0, 1]", getattr(self, name))

    def is_default(self) -> bool:
        return self == CriticConfig()
