"""The one interface every backend implements.

Public ops (:mod:`portarl.ops`) validate their arguments and then call a backend with
inputs that already satisfy the op's contract, so a backend does numerics only.
"""

from __future__ import annotations

import abc

import torch


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run on the given tensors."""


class Backend(abc.ABC):
    #: Registry name: "reference", "cuda", "npu" or "triton" (the Triton kernels on an NPU).
    name: str

    @abc.abstractmethod
    def unavailable_reason(self, device: torch.device) -> str | None:
        """None when this backend can compute on tensors on ``device``, else why not."""

    @abc.abstractmethod
    def logprobs(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float,
        ignore_index: int,
        return_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 ``(logp [N], entropy [N] or None)`` for ``logits`` [..., V], ``labels`` int64 [N].

        ``N`` is the product of the logits' leading dims; labels are flat, int64, validated.
        """

    @abc.abstractmethod
    def kl(
        self,
        logp: torch.Tensor,
        ref_logp: torch.Tensor,
        *,
        estimator: str,
        mask: torch.Tensor | None,
        log_ratio_clamp: float | None,
        max_value: float | None,
    ) -> torch.Tensor:
        """fp32 per-token KL estimate, same shape as ``logp``; ``mask`` is bool or None."""

    def linear_logprobs(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        *,
        temperature: float,
        ignore_index: int,
        return_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 ``(logp [N], entropy [N] or None)`` for ``hidden`` [N, H], ``weight`` [V, H],
        ``bias`` [V] or None, ``labels`` int64 [N] (validated); never an N x V tensor."""
        raise NotImplementedError(f"the {self.name!r} backend does not implement linear_logprobs")

    def __repr__(self) -> str:
        return f"<portarl backend {self.name!r}>"
