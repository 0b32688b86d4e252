"""Triton device code for portarl's fused ops.

Importing this package requires triton. Host-side launch code lives in
:mod:`portarl.backends.cuda`; this package holds only ``@triton.jit`` kernels.
Whether the kernels were built for the Triton interpreter (``TRITON_INTERPRET=1``,
which lets them run on CPU tensors) is decided by triton when the decorators run,
so it is fixed for the life of the process: see :data:`INTERPRETED`.
"""

from portarl.kernels.logprobs import logprobs_forward_kernel, logprobs_grad_kernel
from portarl.kernels.kl import kl_backward_kernel, kl_forward_kernel


def _built_for_interpreter() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - layout of very old triton
        return False
    return isinstance(logprobs_forward_kernel, InterpretedFunction)


#: True when the kernels were decorated under ``TRITON_INTERPRET=1`` and so take CPU tensors.
INTERPRETED: bool = _built_for_interpreter()

if INTERPRETED:
    # triton <= 3.6 with NumPy >= 2.4: range() over a kernel scalar fails in the interpreter
    from portarl.kernels._interpreter import patch_interpreter_index

    patch_interpreter_index()


def round_bf16_in_interpreter(dtype) -> bool:
    """Whether a kernel storing ``dtype`` must round bf16 itself (see :mod:`portarl.kernels.rounding`)."""
    import torch

    return INTERPRETED and dtype == torch.bfloat16

__all__ = [
    "INTERPRETED",
    "kl_backward_kernel",
    "kl_forward_kernel",
    "logprobs_forward_kernel",
    "logprobs_grad_kernel",
    "round_bf16_in_interpreter",
]
