"""The npu backend: torch_npu operators on Ascend; every torch_npu call is in torch_npu_api."""

from __future__ import annotations

import torch

from portarl.backends.base import Backend
from portarl.backends.npu import torch_npu_api
from portarl.backends.reference.kl import torch_kl


class NpuBackend(Backend):
    name = "npu"

    def unavailable_reason(self, device: torch.device) -> str | None:
        reason = torch_npu_api.unavailable_reason()
        if reason is not None:
            return reason
        if device.type != torch_npu_api.device_type:
            return f"the npu backend runs on {torch_npu_api.device_type} tensors, not {device.type}"
        return None

    def logprobs(self, logits, labels, *, temperature, ignore_index, return_entropy):
        from portarl.backends.npu.logprobs import npu_logprobs

        return npu_logprobs(
            logits, labels, temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy
        )

    def linear_logprobs(self, hidden, weight, bias, labels, *, temperature, ignore_index, return_entropy):
        from portarl.backends.npu.linear_logprobs import npu_linear_logprobs

        return npu_linear_logprobs(
            hidden, weight, bias, labels, temperature=temperature, ignore_index=ignore_index,
            return_entropy=return_entropy,
        )

    def kl(self, logp, ref_logp, *, estimator, mask, log_ratio_clamp, max_value):
        return torch_kl(
            logp, ref_logp, estimator=estimator, mask=mask, log_ratio_clamp=log_ratio_clamp, max_value=max_value
        )


BACKEND_CLASS = NpuBackend
