"""portarl.ops.logprobs: per-token log-probabilities (and entropy) from logits."""

from __future__ import annotations

import torch

from portarl.backends.base import Backend
from portarl.backends.dispatch import choose_backend
from portarl.ops._checks import (
    check_float_dtype,
    check_labels,
    check_same_device,
    check_temperature,
    check_tensor,
    shaped_result,
)


def logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    backend: str | Backend | None = None,
):
    """Log-probability of each label under softmax(logits / temperature), and its entropy.

    Contract (every backend, every device):
        z = logits / temperature;  logp = z[label] - logsumexp(z);
        H = logsumexp(z) - sum(softmax(z) * z)

    Args:
        logits: ``[..., V]`` float32, bfloat16 or float16; any strides (a slice such as
            ``logits[:, :-1]`` is read in place, not copied).
        labels: integer ``[...]`` equal to ``logits.shape[:-1]``; each in ``[0, V)`` or
            equal to ``ignore_index``.
        temperature: finite, >= ``TEMPERATURE_MIN`` (1e-6, see :mod:`portarl.ops._checks`): smaller
            ones overflow finite logits once scaled by ``1 / temperature`` in fp32.
        ignore_index: label value marking positions to ignore.
        return_entropy: also return the entropy of each row.
        backend: ``"reference"``, ``"cuda"``, ``"npu"`` or a Backend; default by device.

    Returns:
        ``logp`` float32 of shape ``labels.shape``, or ``(logp, entropy)`` when
        ``return_entropy``. :func:`portarl.ops.computed_by` names the backend that ran.

    Precision: accumulated in fp32 whatever the input dtype (online logsumexp / row max
    shift), so bf16 inputs give fp32-accurate results on the bf16 input values: within
    ``1e-5 * (1 + max|z|)`` of a float64 computation (see portarl.parity.tolerances).

    Masking: ignored positions give logp = 0, H = 0 and a zero gradient, whatever their
    logits hold.

    Non-finite values: ``-inf`` logits (a masked vocabulary) are valid and get probability
    0; a label on a -inf entry gives logp = -inf. A NaN or +inf anywhere in a row makes that
    row's logp and H NaN (never a finite wrong number); so does a row that is entirely -inf.

    Gradient: with respect to ``logits`` through logp and H, in the logits' dtype; the
    backward allocates only that N x V gradient. The forward allocates O(N) plus bounded
    chunks: never an N x V temporary.

    Raises:
        TypeError: a non-tensor argument, non-integer labels, or an unsupported logits dtype.
        ValueError: mismatched shapes or devices, an empty vocabulary, a label outside
            ``[0, V)`` other than ``ignore_index``, or ``temperature`` outside ``[1e-6, inf)``.
    """
    check_tensor("logits", logits)
    check_tensor("labels", labels)
    check_float_dtype("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (int64), got {labels.dtype}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits.shape[:-1] = {tuple(logits.shape[:-1])}"
        )
    check_same_device(("logits", "labels"), (logits, labels))
    temperature = check_temperature(temperature)
    flat_labels = check_labels(labels, logits.shape[-1], ignore_index)

    chosen = choose_backend("logprobs", logits.device, backend)
    if flat_labels.numel() == 0:
        # No rows: keep the graph connected without launching anything.
        logp = logits.float().sum(-1) * 0.0
        entropy = logp.clone() if return_entropy else None
    else:
        logp, entropy = chosen.logprobs(
            logits,
            flat_labels,
            temperature=temperature,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
        )
    return shaped_result(logp, entropy, labels.shape, chosen.name, return_entropy)
