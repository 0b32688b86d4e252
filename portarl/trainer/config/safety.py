"""The ``precision`` and ``guards`` sections of the training config: the settings that keep
a run's numbers sound (dtypes, fp32 master weights, loss scaling, emulation profiles) and
what the trainer does when they are not (skips, spike detectors, update snapshots).
Re-exported by :mod:`portarl.trainer.config`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from portarl.trainer.config.fields import ConfigError, _check, _number, _positive_int


@dataclasses.dataclass
class PrecisionConfig:
    #: Parameters and compute: "fp32", "bf16" or "fp16".
    dtype: str = "fp32"
    #: fp32 master weights and fp32 optimizer state next to bf16 / fp16 parameters:
    #: "auto" (default) = on for bf16 / fp16; false keeps the optimizer in the parameters'
    #: dtype (a warning at start; small updates get lost, see update/lost_frac; refused for
    #: fp16, where AdamW's eps and squared gradients underflow).
    master_weights_fp32: Any = "auto"
    #: fp16 loss scaling: "dynamic", a fixed number, or None (off). Ignored for fp32 / bf16.
    loss_scale: Any = "dynamic"
    #: lm-head logits: "fp32" (head computed in fp32) or "model" (model dtype; the log-prob
    #: op still accumulates in fp32).
    logits: str = "fp32"
    #: Numerics: "portarl" (the fp32 contract), or an EMULATION profile of an Ascend stack
    #: ("npu-emulated", "npu-emulated-hf32"; see portarl.backends.emulation), or a list of switches.
    numerics: Any = "portarl"
    #: Force one ops backend ("reference", "cuda", "npu", "triton": the Triton kernels on an
    #: NPU through triton-ascend); None: by device.
    backend: str | None = None

    @property
    def use_master(self) -> bool:
        """fp32 master weights and optimizer state: on for bf16 / fp16 unless set to false."""
        return self.dtype != "fp32" and self.master_weights_fp32 is not False

    def validate(self):
        from portarl.backends.emulation import resolve_profile

        try:
            resolve_profile(self.numerics)
        except ValueError as err:
            raise ConfigError(f"precision.numerics: {err}") from None
        from portarl.backends.registry import BACKEND_NAMES

        _check(self.backend in (None, *BACKEND_NAMES), "precision.backend",
               f"must be {', '.join(BACKEND_NAMES)} or null", self.backend)
        _check(self.dtype in ("fp32", "bf16", "fp16"), "precision.dtype", "must be fp32, bf16 or fp16", self.dtype)
        _check(self.logits in ("fp32", "model"), "precision.logits", "must be 'fp32' or 'model'", self.logits)
        _check(self.master_weights_fp32 in ("auto", True, False) and (self.master_weights_fp32 is not None),
               "precision.master_weights_fp32", "must be auto, true or false", self.master_weights_fp32)
        if self.dtype == "fp16" and self.master_weights_fp32 is False:
            raise ConfigError("precision.master_weights_fp32=false is refused with precision.dtype=fp16: AdamW's eps "
                              "(1e-8) is 0 in fp16 and squared gradients underflow, so the first step divides by zero "
                              "and the weights become inf/NaN. Use master_weights_fp32=auto (fp32 masters and optimizer "
                              "state, dynamic loss scaling) or precision.dtype=bf16")
        if isinstance(self.loss_scale, str) and self.loss_scale != "dynamic":
            try:
                self.loss_scale = float(self.loss_scale)
            except ValueError:
                pass
        ok = self.loss_scale in (None, "dynamic") or (
            isinstance(self.loss_scale, (int, float)) and not isinstance(self.loss_scale, bool)
            and math.isfinite(self.loss_scale) and self.loss_scale > 0
        )
        _check(ok, "precision.loss_scale", "must be 'dynamic', a positive number or null", self.loss_scale)


@dataclasses.dataclass
class GuardsConfig:
    #: Stop (with a checkpoint) after this many skipped steps in a row.
    max_consecutive_skips: int = 3
    #: Spike detectors: rolling window, minimum history, and factor on the MAD.
    spike_window: int = 20
    spike_min_history: int = 5
    spike_factor: float = 6.0
    #: ... and at least this many times the rolling median. Grad norms of small-group GRPO
    #: are heavy-tailed: healthy runs of the demo task jump to 9.4x their rolling median
    #: (docs/stability.md), so 3x flagged a dozen healthy steps per run; the failures the
    #: detector exists for (an exploding or mis-scaled gradient) are 100x jumps.
    spike_ratio: float = 20.0
    #: Fixed bounds, judged from the first step on (the relative test needs
    #: spike_min_history clean steps first): a pre-clip grad norm or a KL above these is a
    #: spike. None: no fixed bound.
    grad_norm_ceiling: float | None = 50.0
    kl_ceiling: float | None = 1.0
    #: Noise floors: a grad norm / KL at or below these is never a relative spike.
    grad_norm_floor: float = 1.0
    kl_floor: float = 0.05
    #: What a spike does: "log" (an event), "skip" (skip that optimizer step, as a
    #: non-finite value would) or "stop" (skip it, save a checkpoint, stop the run).
    spike_action: str = "log"
    #: Copy the optimizer's parameters and state before each step so that a non-finite
    #: update is undone bitwise (one extra copy while the step runs). false: a non-finite
    #: update stops the run, keeping the last good checkpoint.
    update_snapshot: bool = True
    #: master_weights_fp32=false only: event when update/lost_frac (share of parameters with
    #: a non-zero AdamW update whose value did not change) exceeds this.
    lost_frac_warn: float = 0.5
    #: A completion of at least this many tokens, all the same token, is degenerate.
    degenerate_min_tokens: int = 4
    #: Event when the degenerate fraction rises this much above its rolling median.
    degenerate_rise: float = 0.25

    def validate(self):
        _positive_int(self, "guards", "max_consecutive_skips", "spike_window", "spike_min_history", "degenerate_min_tokens")
        _number(self, "guards", "spike_factor", low=0.0)
        _number(self, "guards", "spike_ratio", low=1.0, strict=False)
        _number(self, "guards", "grad_norm_ceiling", low=0.0, allow_none=True)
        _number(self, "guards", "kl_ceiling", low=0.0, allow_none=True)
        _number(self, "guards", "grad_norm_floor", low=0.0, strict=False)
        _number(self, "guards", "kl_floor", low=0.0, strict=False)
        _check(self.spike_action in ("log", "skip", "stop"), "guards.spike_action", "must be log, skip or stop",
               self.spike_action)
        _check(0 <= self.lost_frac_warn <= 1, "guards.lost_frac_warn", "must be in [0, 1]", self.lost_frac_warn)
        _check(0 < self.degenerate_rise <= 1, "guards.degenerate_rise", "must be in (0, 1]", self.degenerate_rise)
