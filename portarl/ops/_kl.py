"""portarl.ops.kl: per-token KL(pi || pi_ref) estimators k1, k2, k3."""

from __future__ import annotations

import torch

from portarl.backends.base import Backend
from portarl.backends.dispatch import choose_backend
from portarl.ops._checks import check_float_dtype, check_positive, check_same_device, check_tensor, tag

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    *,
    estimator: str = "k3",
    mask: torch.Tensor | None = None,
    log_ratio_clamp: float | None = 20.0,
    max_value: float | None = 10.0,
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of the sampled tokens.

    With ``d = ref_logp - logp`` (Schulman's estimators):
        ``k1`` = -d                  unbiased, high variance
        ``k2`` = d**2 / 2            biased, low variance
        ``k3`` = exp(d) - d - 1      unbiased, low variance near d = 0, >= 0

    Clamps (k3 only, because exp(d) is unbounded; verl clamps the same way): d is clamped
    to ``[-log_ratio_clamp, log_ratio_clamp]`` before exp, and the result to at most
    ``max_value``. Pass None to disable either. Where a clamp is active the gradient is 0
    (torch.clamp's convention, boundary inclusive).

    Args:
        logp, ref_logp: same shape, float32 / bfloat16 / float16, one device.
        estimator: "k1", "k2" or "k3".
        mask: optional, same shape; bool, or numbers where nonzero means keep.

    Returns:
        float32 tensor of ``logp.shape`` (computed in fp32). Masked positions are 0 with a
        zero gradient even if the inputs hold NaN or inf there. A NaN on an unmasked
        position gives NaN; ref_logp = -inf gives k1 = k2 = inf, and k3 = max_value with
        zero gradient under the default clamps.

    Gradient: with respect to both inputs, each in its input's dtype. For k3 inside the
    clamps, d k3 / d logp = 1 - exp(ref_logp - logp).
    """
    check_tensor("logp", logp)
    check_tensor("ref_logp", ref_logp)
    check_float_dtype("logp", logp)
    check_float_dtype("ref_logp", ref_logp)
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp shape {tuple(logp.shape)} and ref_logp shape {tuple(ref_logp.shape)} must match")
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
    tensors = [logp, ref_logp]
    if mask is not None:
        check_tensor("mask", mask)
        if mask.shape != logp.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} must equal logp shape {tuple(logp.shape)}")
        tensors.append(mask)
        mask = mask if mask.dtype == torch.bool else mask != 0
    check_same_device(("logp", "ref_logp", "mask")[: len(tensors)], tuple(tensors))
    log_ratio_clamp = check_positive("log_ratio_clamp", log_ratio_clamp, allow_none=True)
    max_value = check_positive("max_value", max_value, allow_none=True)

    chosen = choose_backend("kl", logp.device, backend)
    value = chosen.kl(
        logp, ref_logp, estimator=estimator, mask=mask, log_ratio_clamp=log_ratio_clamp, max_value=max_value
    )
    tag(value, chosen.name)
    return value
