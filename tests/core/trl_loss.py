"""TRL 1.16's GRPO loss as a plain callable, for comparisons on identical inputs.

``trl_loss`` calls TRL's own ``GRPOTrainer._compute_loss`` (and, through it, its
``get_high_entropy_mask``) unbound, on a stand-in ``self`` that holds only what that method
reads: the loss type and its parameters, a one-process accelerator, one accumulation step.
The model forward is replaced by the log-probs and entropies given, so the comparison is
of the loss arithmetic alone, on the same tensors.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed")


class _OneProcess:
    """accelerate's Accelerator, reduced to one process (gather / pad / reduce are identities)."""

    num_processes = 1
    sync_gradients = True

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(loss_type: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, *, entropies: torch.Tensor | None = None, top_entropy_quantile: float = 1.0,
             epsilon: float = 0.2, epsilon_high: float | None = None, sapo_temperature_pos: float = 1.0,
             sapo_temperature_neg: float = 1.05) -> torch.Tensor:
    """TRL's scalar loss for ``loss_type`` with ``beta = 0`` (no KL), no vLLM correction, no
    entropy bonus, one process, one accumulation step. ``logp`` may require grad."""
    args = types.SimpleNamespace(delta=None, sapo_temperature_pos=sapo_temperature_pos,
                                 sapo_temperature_neg=sapo_temperature_neg, steps_per_generation=1,
                                 use_bias_correction_kl=False)
    ent = torch.zeros_like(logp) if entropies is None else entropies
    fake = types.SimpleNamespace(
        args=args, loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high, beta=0.0, top_entropy_quantile=top_entropy_quantile,
        off_policy_mask_threshold=None, importance_sampling_level="token", use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, accelerator=_OneProcess(), model=types.SimpleNamespace(training=True),
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, ent, None),
    )
    fake.get_high_entropy_mask = types.MethodType(trl_grpo.GRPOTrainer.get_high_entropy_mask, fake)
    b, t = logp.shape
    inputs = {
        "prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": advantages, "old_per_token_logps": old_logp,
        "num_items_in_batch": mask.sum().float(),
    }
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs)
