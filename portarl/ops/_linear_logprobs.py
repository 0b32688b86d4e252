"""portarl.ops.linear_logprobs: log-probs (and entropy) of ``hidden @ weight.T + bias``
without ever holding the N x V logits."""

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


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    backend: str | Backend | None = None,
):
    """Log-probability of each label under softmax((hidden @ weight.T + bias) / T), and entropy.

    Contract: exactly :func:`portarl.ops.logprobs` applied to ``z = hidden @ weight.T + bias``
    computed with fp32 accumulation from the inputs' values, without materialising z.

    Args:
        hidden: ``[..., H]`` float32, bfloat16 or float16; any strides.
        weight: ``[V, H]`` (an lm head's layout), the same dtype as ``hidden``.
        labels: integer ``[...]`` equal to ``hidden.shape[:-1]``; each in ``[0, V)`` or
            equal to ``ignore_index``.
        bias: optional ``[V]``, the same dtype as ``hidden``.
        temperature: in ``[1e-6, inf)`` as for :func:`portarl.ops.logprobs` (divides the logits;
            smaller values overflow finite logits in fp32).
        ignore_index: label value marking positions to ignore.
        return_entropy: also return the entropy of each row.
        backend: ``"reference"``, ``"cuda"`` or ``"npu"`` or a Backend; default by device.

    Returns:
        ``logp`` float32 of shape ``labels.shape``, or ``(logp, entropy)``.

    Precision: logits accumulated in fp32 (products of bf16/fp16 inputs are exact in fp32),
    softmax statistics in fp32: within ``1e-5 * (1 + max|z|)`` of float64 on the same input
    values (portarl.parity.tolerances).

    Masking: ignored positions give logp = 0, H = 0 and contribute a zero gradient to
    hidden, weight and bias, whatever their hidden states hold.

    Non-finite values: a NaN or inf reaching a row's logits makes that row's logp and H NaN
    (a NaN in a weight row therefore makes every row NaN); never a finite wrong number.

    Gradient: with respect to hidden, weight and bias through logp and H, returned in the
    inputs' dtypes; the weight (and bias) gradient is accumulated in fp32 over row chunks
    before its single final cast.

    Memory: neither direction allocates an N x V tensor. Logits exist only as tiles of at
    most ``PORTARL_CHUNK_ELEMENTS`` elements (default 2**24); backward recomputes them.
    Beyond inputs, outputs and gradients: O(N) row statistics, fp32 [N, H] copies of hidden
    and its gradient accumulator, and per backend either weight-block fp32 tiles (reference)
    or one fp32 [V, H] weight-gradient accumulator (cuda, npu) - all independent of the
    N x V product.

    Raises:
        TypeError: a non-tensor argument, non-integer labels, an unsupported or mismatched dtype.
        ValueError: weight not 2-D, H mismatch, bias not [V], shape mismatch of labels,
            devices differ, V = 0, labels out of range, temperature outside ``[1e-6, inf)``.
    """
    check_tensor("hidden", hidden)
    check_tensor("weight", weight)
    check_tensor("labels", labels)
    check_float_dtype("hidden", hidden)
    check_float_dtype("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H] (an lm head's weight), got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight has V = 0 rows: the vocabulary must not be empty")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden.shape[-1] must equal weight.shape[1] = {weight.shape[1]} (H), got hidden shape "
            f"{tuple(hidden.shape)}; weight is [V, H], pass the lm head's weight, not its transpose"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast one so both share a dtype "
            f"(accumulation is fp32 either way)"
        )
    if bias is not None:
        check_tensor("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias is {bias.dtype} but weight is {weight.dtype}; cast the bias to {weight.dtype}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (int64), got {labels.dtype}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}"
        )
    tensors = (hidden, weight, labels) + ((bias,) if bias is not None else ())
    check_same_device(("hidden", "weight", "labels", "bias")[: len(tensors)], tensors)
    temperature = check_temperature(temperature)  # the same range as ops.logprobs
    flat_labels = check_labels(labels, weight.shape[0], ignore_index)

    chosen = choose_backend("linear_logprobs", hidden.device, backend)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if flat_labels.numel() == 0:
        zero = (flat_hidden.float().sum() + weight.float().sum() * 0.0) * 0.0
        if bias is not None:
            zero = zero + bias.float().sum() * 0.0
        logp = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device) + zero
        entropy = logp.clone() if return_entropy else None
    else:
        logp, entropy = chosen.linear_logprobs(
            flat_hidden, weight, bias, flat_labels,
            temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy,
        )
    return shaped_result(logp, entropy, labels.shape, chosen.name, return_entropy)
