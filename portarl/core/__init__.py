"""portarl.core: the GRPO-family algorithm, device-free PyTorch on top of portarl.ops.

Imports and runs without triton or torch_npu. Pieces:

- :func:`compute_advantages` and the :data:`ADVANTAGE_ESTIMATORS` registry;
- :func:`policy_loss` and the :data:`POLICY_LOSSES` registry;
- :func:`kl_per_token`, :func:`kl_penalized_rewards`;
- :func:`aggregate_loss`: one aggregation for every term;
- :func:`correct_mismatch`: rollout-vs-trainer importance weights;
- :func:`portarl.core.entropy_mask.high_entropy_mask`: entropy masking (top-q tokens);
- :class:`GRPOConfig` and :func:`compute_loss`: the entry point.
"""

from portarl.core.advantages import ADVANTAGE_ESTIMATORS, AdvantageResult, compute_advantages
from portarl.core.aggregation import AGG_MODES, aggregate_loss, sequence_count, token_count
from portarl.core.config import GRPOConfig
from portarl.core.kl import kl_penalized_rewards, kl_per_token
from portarl.core.loss import compute_loss
from portarl.core.mismatch import MISMATCH_MODES, MismatchCorrection, correct_mismatch
from portarl.core.policy_losses import POLICY_LOSSES, policy_loss
from portarl.core.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "AdvantageResult",
    "GRPOConfig",
    "MISMATCH_MODES",
    "MismatchCorrection",
    "POLICY_LOSSES",
    "Registry",
    "aggregate_loss",
    "compute_advantages",
    "compute_loss",
    "correct_mismatch",
    "kl_penalized_rewards",
    "kl_per_token",
    "policy_loss",
    "sequence_count",
    "token_count",
]
