"""NPU numerics EMULATION: documented numeric behaviours of common Ascend training stacks,
reproduced on any device, so a machine without an NPU can see whether and when they make a
run part from portarl's fp32-contract path.

This is emulation, not Ascend hardware: it copies the *documented* dtype and precision
choices of a typical stack (verl on torch_npu), not Ascend kernels. Every switch names its
public source. The default ``npu-emulated`` profile holds only switches that are that
stack's defaults.

Switches:
- ``bf16_logprobs`` (default): per-token log-probs come back in the logits' dtype.
  Source: torch_npu ``npu_cross_entropy_loss`` returns ``loss`` in the input dtype (Ascend
  Extension for PyTorch API reference); verl's NPU path feeds it the model's bf16 logits.
  Emulated: logits in the model dtype, log-prob values rounded to bf16 (the gradient
  passes through, as the operator's backward is taken in its own precision).
- ``entropy_no_upcast`` (default): entropy = logsumexp(z) - sum(softmax(z) * z) evaluated in
  the logits' dtype. Source: verl ``verl/utils/torch_functional.py::entropy_from_logits``
  (the same formula as TRL's), used when fused kernels are off (the default).
- ``hf32_matmul`` (off by default): fp32 matmuls in HF32, Ascend's TF32 analogue, enabled by
  ``torch.npu.matmul.allow_hf32 = True`` (default False per torch_npu docs) or a
  ``cube_math_type`` allowing fp32 down-precision. Emulated by rounding fp32 matmul inputs
  to 10 explicit mantissa bits (TF32-like; the exact HF32 format is not published).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.overrides import TorchFunctionMode


@dataclasses.dataclass(frozen=True)
class Switch:
    name: str
    summary: str
    source: str
    stack_default: bool


SWITCHES = {
    s.name: s
    for s in (
        Switch("bf16_logprobs", "log-probs returned in the logits' dtype (bf16)",
               "torch_npu npu_cross_entropy_loss: loss has the input dtype; verl feeds bf16 logits", True),
        Switch("entropy_no_upcast", "entropy computed in the logits' dtype",
               "verl utils/torch_functional.py entropy_from_logits (no float upcast)", True),
        Switch("hf32_matmul", "fp32 matmuls in HF32 (TF32-like 10-bit mantissa inputs)",
               "torch_npu torch.npu.matmul.allow_hf32 (default False) / cube_math_type", False),
    )
}

PROFILES = {
    "portarl": (),
    "npu-emulated": tuple(name for name, s in SWITCHES.items() if s.stack_default),
    "npu-emulated-hf32": tuple(SWITCHES),
}


def resolve_profile(name_or_switches) -> frozenset[str]:
    """A profile name, or an iterable of switch names, as a set of switches."""
    if isinstance(name_or_switches, str):
        if name_or_switches not in PROFILES:
            raise ValueError(f"numerics profile {name_or_switches!r} is not one of {', '.join(PROFILES)}")
        return frozenset(PROFILES[name_or_switches])
    switches = frozenset(name_or_switches or ())
    unknown = sorted(switches - set(SWITCHES))
    if unknown:
        raise ValueError(f"unknown emulation switch(es) {unknown}; known: {', '.join(SWITCHES)}")
    return switches


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 ``x`` rounded to nearest (ties away) with ``bits`` explicit mantissa bits."""
    drop = 23 - bits
    as_int = x.view(torch.int32)
    rounded = (as_int + (1 << (drop - 1))) & ~((1 << drop) - 1)
    out = rounded.view(torch.float32)
    return torch.where(torch.isfinite(x), out, x)


class HF32Matmuls(TorchFunctionMode):
    """Inside this mode, fp32 ``linear`` / ``matmul`` / ``mm`` / ``bmm`` see HF32-rounded inputs."""

    _FUNCS = {torch.nn.functional.linear, torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul,
              torch.Tensor.__matmul__}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FUNCS:
            args = tuple(
                round_mantissa(a, 10) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 and i < 2 else a
                for i, a in enumerate(args)
            )
        return func(*args, **kwargs)


def matmul_context(switches: frozenset[str]):
    return HF32Matmuls() if "hf32_matmul" in switches else contextlib.nullcontext()


def bf16_valued(x: torch.Tensor) -> torch.Tensor:
    """Values rounded through bf16, gradient passed straight through."""
    return x + (x.to(torch.bfloat16).float() - x).detach()


def entropy_in_logits_dtype(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """verl's entropy_from_logits, in the logits' dtype (no upcast), as a float32 tensor."""
    z = logits / temperature
    pd = torch.softmax(z, dim=-1)
    return (torch.logsumexp(z, dim=-1) - (pd * z).sum(dim=-1)).float()
