"""The cuda backend: Triton kernels from :mod:`portarl.kernels`, launched from the host.

Takes CUDA tensors, and CPU tensors when the kernels were built for the Triton
interpreter (``TRITON_INTERPRET=1`` set before portarl's kernels were imported): that is
how CI exercises every kernel without a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from portarl.backends.base import Backend


def _kernels():
    import portarl.kernels

    return portarl.kernels


class CudaBackend(Backend):
    name = "cuda"

    def unavailable_reason(self, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed: `pip install 'portarl[cuda]'`"
        if device.type == "cuda":
            return None if torch.cuda.is_available() else "torch sees no CUDA device"
        if device.type == "cpu":
            if _kernels().INTERPRETED:
                return None
            hint = "" if os.environ.get("TRITON_INTERPRET") == "1" else "; set TRITON_INTERPRET=1 before importing portarl"
            return f"Triton kernels take CPU tensors only when built for the Triton interpreter{hint}"
        return f"the Triton kernels run on CUDA tensors, not {device.type}"

    def logprobs(self, logits, labels, *, temperature, ignore_index, return_entropy):
        from portarl.backends.cuda.logprobs import triton_logprobs

        return triton_logprobs(
            logits, labels, temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy
        )

    def linear_logprobs(self, hidden, weight, bias, labels, *, temperature, ignore_index, return_entropy):
        from portarl.backends.cuda.linear_heads import linear_logprobs

        return linear_logprobs(
            hidden, weight, bias, labels, temperature=temperature, ignore_index=ignore_index,
            return_entropy=return_entropy,
        )

    def kl(self, logp, ref_logp, *, estimator, mask, log_ratio_clamp, max_value):
        from portarl.backends.cuda.kl import triton_kl

        return triton_kl(
            logp, ref_logp, estimator=estimator, mask=mask, log_ratio_clamp=log_ratio_clamp, max_value=max_value
        )


BACKEND_CLASS = CudaBackend
