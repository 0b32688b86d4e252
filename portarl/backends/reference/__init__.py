"""The reference backend: pure PyTorch on any device, and the fallback for the others."""

from __future__ import annotations

import torch

from portarl.backends.base import Backend
from portarl.backends.reference.kl import torch_kl
from portarl.backends.reference.logprobs import reference_logprobs


class ReferenceBackend(Backend):
    name = "reference"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def logprobs(self, logits, labels, *, temperature, ignore_index, return_entropy):
        return reference_logprobs(
            logits, labels, temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy
        )

    def linear_logprobs(self, hidden, weight, bias, labels, *, temperature, ignore_index, return_entropy):
        from portarl.backends.reference.linear_logprobs import reference_linear_logprobs

        return reference_linear_logprobs(
            hidden, weight, bias, labels, temperature=temperature, ignore_index=ignore_index,
            return_entropy=return_entropy,
        )

    def kl(self, logp, ref_logp, *, estimator, mask, log_ratio_clamp, max_value):
        return torch_kl(
            logp, ref_logp, estimator=estimator, mask=mask, log_ratio_clamp=log_ratio_clamp, max_value=max_value
        )


BACKEND_CLASS = ReferenceBackend
