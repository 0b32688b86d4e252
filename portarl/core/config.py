"""``GRPOConfig``: every knob of the loss, validated when built.

Defaults are GRPO with DAPO's clip-higher: group-normalised advantages, ``ppo_clip`` with
eps 0.2 / 0.28 and dual clip 3, no KL (kl_coef 0; k3 when it is > 0), ``token-mean``
aggregation, truncated importance sampling (C = 2) only when rollout log-probs are given.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from portarl.core.advantages import ADVANTAGE_ESTIMATORS
from portarl.core.aggregation import AGG_MODES
from portarl.core.mismatch import MISMATCH_MODES
from portarl.core.policy_losses import POLICY_LOSSES
from portarl.core.yaml_numbers import non_bool_field, number_from_yaml_string

KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    # --- advantages (compute_advantages) ---
    #: Estimator name in ADVANTAGE_ESTIMATORS: "grpo", "rloo", "reinforce_pp"; or "gae": PPO
    #: with a value model (the trainer's ``critic`` section; :mod:`portarl.core.gae`).
    advantage_estimator: str = "grpo"
    #: grpo only: "group" (GRPO), "batch", or "none" (Dr. GRPO: no std division).
    advantage_scale: str = "group"
    #: Added to the std before dividing (grpo, reinforce_pp).
    advantage_eps: float = 1e-6
    #: Drop groups whose rewards are all equal (DAPO dynamic sampling).
    drop_zero_std_groups: bool = False

    # --- policy loss (policy_loss) ---
    #: Name in POLICY_LOSSES: "ppo_clip", "gspo", "reinforce", "cispo", "sapo".
    policy_loss: str = "ppo_clip"
    #: ppo_clip lower / upper clip: ratio clipped to [1 - clip_eps_low, 1 + clip_eps_high].
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    #: ppo_clip dual clip c (> 1) bounding the loss of negative-advantage tokens; None: off.
    dual_clip: float | None = 3.0
    #: gspo's sequence-ratio clip (GSPO paper values).
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    #: Log-ratios are clamped to +- this before exp.
    log_ratio_clamp: float = 20.0
    #: cispo: the IS weight is clipped to [cispo_ratio_min, cispo_ratio_max] (TRL's epsilon_high
    #: with loss_type="cispo"; MiniMax-M1's 1 + eps_high^IS). None: no lower bound.
    cispo_ratio_max: float = 5.0
    cispo_ratio_min: float | None = None
    #: sapo: gate temperatures for positive / non-positive advantages (TRL's
    #: sapo_temperature_pos / sapo_temperature_neg).
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05

    # --- KL to the reference policy ---
    #: Weight of the KL term (0: no reference model needed).
    kl_coef: float = 0.0
    #: "k1", "k2" or "k3" (portarl.ops.kl).
    kl_estimator: str = "k3"
    #: Put k1 into the rewards (kl_penalized_rewards) instead of a loss term.
    kl_in_reward: bool = False
    #: k3 clamps (portarl.ops.kl): log-ratio clamp before exp and cap on the value.
    kl_log_ratio_clamp: float | None = 20.0
    kl_max_value: float | None = 10.0
    #: Adaptive KL controller (PPO paper; verl's AdaptiveKLController): when set, kl_coef is
    #: the start value and is multiplied each iteration by 1 + clip(kl / kl_target - 1,
    #: -0.2, 0.2) * n / kl_horizon (n: sequences in the iteration). None: fixed kl_coef.
    kl_target: float | None = None
    kl_horizon: int = 10000

    # --- entropy bonus ---
    #: loss -= entropy_coef * aggregated entropy (needs the entropy from ops.logprobs).
    entropy_coef: float = 0.0
    #: Entropy masking (TRL's top_entropy_quantile, "high-entropy minority tokens"): only the
    #: top q of a micro-batch's valid tokens by entropy get policy gradient (1.0: all).
    top_entropy_quantile: float = 1.0

    # --- mixture of experts ---
    #: Weight of the router load-balancing loss (transformers' ``load_balancing_loss_func``,
    #: Switch Transformer eq. 4-6, over each training forward's real tokens) added to the
    #: loss of a mixture-of-experts model; logged as ``moe/aux_loss``. 0: off, as in
    #: verl's / slime's RL recipes (the router still learns through the policy loss).
    router_aux_coef: float = 0.0

    # --- aggregation (aggregate_loss), shared by every term ---
    #: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum" or "seq-mean-token-sum-norm"
    #: (portarl.core.aggregation.aggregate_loss).
    loss_agg_mode: str = "token-mean"
    #: The constant of seq-mean-token-sum-norm (Dr. GRPO); required for that mode.
    max_response_length: int | None = None

    # --- rollout-mismatch correction (correct_mismatch), used when rollout log-probs are given ---
    #: "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", or None (metrics only).
    mismatch_mode: str | None = "token_truncate"
    mismatch_truncate_c: float = 2.0
    mismatch_mask_low: float = 0.5
    mismatch_mask_high: float = 2.0

    # --- on-policy distillation ---
    #: A frozen teacher's per-token reverse KL as a dense advantage: ``{teacher: PATH, coef:
    #: 1.0, estimator: k1, rewards: true}``. teacher: a causal LM directory (or a built-in
    #: model name) with the student's tokenizer; each sampled token's advantage gets
    #: ``- coef * kl_t``, kl_t = logp_student(t) - logp_teacher(t) (k1) or its k3 form,
    #: beside the rewards' advantage (``rewards: true``) or alone (false). None: off.
    distill: dict | None = None

    # --- stability guard ---
    #: Leave out of the loss (and count) valid tokens whose logp / old_logp is not finite,
    #: instead of letting one NaN poison the step. False raises instead.
    drop_nonfinite_tokens: bool = True

    def __post_init__(self):
        def choice(field, allowed):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"GRPOConfig.{field}={value!r} is not one of {', '.join(map(repr, allowed))}")

        def number(field, *, low=None, high=None, allow_none=False, strict=True, integer=False):
            value = getattr(self, field)
            if value is None and allow_none:
                return
            parsed = number_from_yaml_string(value, integer)  # YAML 1.1 reads 1e-3 (no dot) as a string
            if parsed is not value:
                object.__setattr__(self, field, parsed)  # frozen dataclass
                value = parsed
            kind = int if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
                what = "an integer" if integer else "a number"
                raise ValueError(f"GRPOConfig.{field} must be {what}, got {value!r}")
            if low is not None and (value < low or (strict and value == low)):
                raise ValueError(f"GRPOConfig.{field} must be {'>' if strict else '>='} {low}, got {value}")
            if high is not None and value >= high:
                raise ValueError(f"GRPOConfig.{field} must be < {high}, got {value}")

        if (bad := non_bool_field(self)) is not None:
            raise ValueError(f"GRPOConfig.{bad[0]} must be true or false, got {bad[1]!r}")
        choice("advantage_estimator", (*ADVANTAGE_ESTIMATORS.names(), "gae"))
        if self.distill is not None:
            object.__setattr__(self, "distill", distill_options(self.distill))
        choice("advantage_scale", ("group", "batch", "none"))
        choice("policy_loss", POLICY_LOSSES.names())
        choice("kl_estimator", KL_ESTIMATORS)
        choice("loss_agg_mode", AGG_MODES)
        choice("mismatch_mode", (*MISMATCH_MODES, None))
        number("advantage_eps", low=0.0, strict=False)
        number("clip_eps_low", low=0.0, high=1.0)
        number("clip_eps_high", low=0.0)
        number("dual_clip", low=1.0, allow_none=True)
        number("gspo_eps_low", low=0.0, high=1.0)
        number("gspo_eps_high", low=0.0)
        number("log_ratio_clamp", low=0.0)
        number("cispo_ratio_max", low=0.0)
        number("cispo_ratio_min", low=0.0, allow_none=True)
        if self.cispo_ratio_min is not None and self.cispo_ratio_min >= self.cispo_ratio_max:
            raise ValueError(f"GRPOConfig.cispo_ratio_min ({self.cispo_ratio_min}) must be < cispo_ratio_max "
                             f"({self.cispo_ratio_max})")
        number("sapo_temperature_pos", low=0.0)
        number("sapo_temperature_neg", low=0.0)
        number("top_entropy_quantile", low=0.0)
        if self.top_entropy_quantile > 1:
            raise ValueError(f"GRPOConfig.top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile}")
        number("kl_coef", low=0.0, strict=False)
        number("kl_log_ratio_clamp", low=0.0, allow_none=True)
        number("kl_max_value", low=0.0, allow_none=True)
        number("entropy_coef", low=0.0, strict=False)
        number("router_aux_coef", low=0.0, strict=False)
        number("mismatch_truncate_c", low=1.0, strict=False)
        number("mismatch_mask_low", low=0.0, high=1.0)
        number("mismatch_mask_high", low=1.0)
        number("max_response_length", low=0, allow_none=True, integer=True)
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.max_response_length is None:
            raise ValueError("GRPOConfig.loss_agg_mode='seq-mean-token-sum-norm' needs max_response_length")
        number("kl_target", low=0.0, allow_none=True)
        number("kl_horizon", low=0, integer=True)
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("GRPOConfig.kl_target needs kl_coef > 0 (the controller's start value)")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GRPOConfig":
        """Build from a mapping (a YAML section, say); unknown keys are an error, not ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown GRPOConfig field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def policy_loss_options(self) -> dict[str, Any]:
        if self.policy_loss == "ppo_clip":
            return dict(eps_low=self.clip_eps_low, eps_high=self.clip_eps_high, dual_clip=self.dual_clip,
                        log_ratio_clamp=self.log_ratio_clamp)
        if self.policy_loss == "gspo":
            return dict(eps_low=self.gspo_eps_low, eps_high=self.gspo_eps_high, log_ratio_clamp=self.log_ratio_clamp)
        if self.policy_loss == "reinforce":
            return dict(log_ratio_clamp=self.log_ratio_clamp)
        if self.policy_loss == "cispo":
            return dict(ratio_max=self.cispo_ratio_max, ratio_min=self.cispo_ratio_min,
                        log_ratio_clamp=self.log_ratio_clamp)
        if self.policy_loss == "sapo":
            return dict(temperature_pos=self.sapo_temperature_pos, temperature_neg=self.sapo_temperature_neg,
                        log_ratio_clamp=self.log_ratio_clamp)
        return {}  # a user-registered loss takes its defaults

    def advantage_options(self) -> dict[str, Any]:
        if self.advantage_estimator == "grpo":
            return dict(scale=self.advantage_scale, eps=self.advantage_eps)
        if self.advantage_estimator == "reinforce_pp":
            return dict(eps=self.advantage_eps)
        return {}


#: ``loss.distill`` keys and their defaults.
DISTILL_DEFAULTS = {"teacher": None, "coef": 1.0, "estimator": "k1", "rewards": True}


def distill_options(value) -> dict:
    """``loss.distill`` checked and completed with :data:`DISTILL_DEFAULTS`."""
    if not isinstance(value, dict):
        raise ValueError(f"GRPOConfig.distill must be a mapping {{teacher: PATH, coef: 1.0, estimator: k1, rewards: "
                         f"true}} or null, got {value!r}")
    unknown = sorted(set(value) - set(DISTILL_DEFAULTS))
    if unknown:
        raise ValueError(f"GRPOConfig.distill: unknown keys {unknown}; known: {', '.join(DISTILL_DEFAULTS)}")
    out = {**DISTILL_DEFAULTS, **value}
    if not isinstance(out["teacher"], str) or not out["teacher"]:
        raise ValueError(f"GRPOConfig.distill.teacher must name the teacher (a model directory or a built-in model), "
                         f"got {out['teacher']!r}")
    coef = number_from_yaml_string(out["coef"], False)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef <= 0:
        raise ValueError(f"GRPOConfig.distill.coef must be a number > 0, got {out['coef']!r}")
    out["coef"] = float(coef)
    if out["estimator"] not in ("k1", "k3"):
        raise ValueError(f"GRPOConfig.distill.estimator must be 'k1' (logp_student - logp_teacher) or 'k3', got "
                         f"{out['estimator']!r}")
    if not isinstance(out["rewards"], bool):
        raise ValueError(f"GRPOConfig.distill.rewards must be true or false, got {out['rewards']!r}")
    return out
