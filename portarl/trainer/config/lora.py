"""The ``model.lora`` config section (LoRA adapters through peft, see :mod:`portarl.assets.lora`),
apart from :mod:`portarl.trainer.config` so that module stays readable; it re-exports
:class:`LoraSection`."""

from __future__ import annotations

import dataclasses
from typing import Any

from portarl.trainer.config.fields import _build, _check, _coerce_numbers, _number, _positive_int

#: LoRA's default targets: the attention and MLP projections of Llama / Qwen2 / Mistral.
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass
class LoraSection:
    """``model.lora``: train low-rank adapters (peft) instead of every weight. Off unless the
    section is set (``--set model.lora.r=16`` turns it on with the other defaults)."""

    #: Rank of each adapter (A: r x in, B: out x r).
    r: int = 16
    #: Scaling numerator: the update is (alpha / r) * B @ A. None: 2 x r (scale 2).
    alpha: float | None = None
    #: Dropout on the adapter's input. 0 by default: above 0 the policy's own log-probs
    #: (old_logp, and so the PPO ratio) become random in training mode.
    dropout: float = 0.0
    #: Module names to adapt (suffixes, as peft matches them), or "all-linear" (every
    #: linear layer but the output head).
    target_modules: Any = dataclasses.field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))

    def validate(self):
        _positive_int(self, "model.lora", "r")
        if self.alpha is None:
            self.alpha = float(2 * self.r)
        _number(self, "model.lora", "alpha", low=0.0)
        _number(self, "model.lora", "dropout", low=0.0, strict=False)
        _check(self.dropout < 1, "model.lora.dropout", "must be in [0, 1)", self.dropout)
        t = self.target_modules
        ok = t == "all-linear" or (isinstance(t, list) and bool(t) and all(isinstance(n, str) and n for n in t))
        _check(ok, "model.lora.target_modules", "must be a non-empty list of module names (e.g. [q_proj, v_proj]) "
               "or 'all-linear'", t)


def lora_section(value) -> LoraSection | None:
    """``model.lora`` as given (a mapping, ``true`` for the defaults, ``null`` / ``false``
    for off, or a :class:`LoraSection`) as a validated section or None."""
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if isinstance(value, dict):
        value = _build(LoraSection, "model.lora", value)
    _check(isinstance(value, LoraSection), "model.lora", "must be a mapping (r, alpha, dropout, target_modules) or null",
           value)
    _coerce_numbers(value, "model.lora")
    value.validate()
    return value
