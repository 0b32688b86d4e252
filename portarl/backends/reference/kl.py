"""Per-token KL estimators with plain torch ops: any device, autograd-differentiable.

Used by the reference backend and, on Ascend, by the npu backend ("KL with torch ops on
the npu device"). See :func:`portarl.ops.kl` for the contract.
"""

from __future__ import annotations

import torch


def torch_kl(logp, ref_logp, *, estimator, mask, log_ratio_clamp, max_value) -> torch.Tensor:
    d = ref_logp.float() - logp.float()
    if mask is not None:
        # Zero d before any arithmetic so nan/inf at masked positions cannot leak into the
        # gradient (0 * nan is nan in the chain rule, where() is not).
        d = torch.where(mask, d, torch.zeros_like(d))
    if estimator == "k1":
        value = -d
    elif estimator == "k2":
        value = 0.5 * d * d
    else:
        dc = d if log_ratio_clamp is None else torch.clamp(d, -log_ratio_clamp, log_ratio_clamp)
        value = torch.exp(dc) - dc - 1.0
        if max_value is not None:
            value = torch.clamp(value, max=max_value)
    if mask is not None:
        value = torch.where(mask, value, torch.zeros_like(value))
    return value
