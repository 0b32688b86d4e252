"""The only module in portarl that touches torch_npu.

Everything Ascend-specific that portarl calls goes through the functions here, so that
(1) the rest of the package imports without torch_npu or CANN, and (2) CPU tests can run
the NPU backend's logic over a stand-in module that implements the documented semantics
(:func:`use_module`). Documented API used, from the Ascend Extension for PyTorch
reference ("torch_npu.npu_cross_entropy_loss", ptaoplist):

    npu_cross_entropy_loss(input, target, weight=None, reduction="mean", ignore_index=-100,
                           label_smoothing=0.0, lse_square_scale_for_zloss=0.0,
                           return_zloss=False) -> (loss, log_prob, zloss, lse_for_zloss)

input [N, C] fp16/bf16/fp32 with 0 < N <= 200000; target int64 [N] in [0, C); a negative
ignore_index ignores nothing; only ``loss`` is differentiable; ``loss`` and ``log_prob``
have the input's dtype.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from types import ModuleType
from typing import Iterator

import torch

#: npu_cross_entropy_loss accepts at most this many rows per call.
CROSS_ENTROPY_MAX_ROWS = 200_000

_SET_ENV_HINT = (
    "source CANN's environment first (e.g. `source /usr/local/Ascend/ascend-toolkit/set_env.sh`)"
)

_module: ModuleType | None = None
_import_error: str | None = None
#: The device type the active module serves: "npu" for torch_npu, "cpu" for a test stand-in.
device_type = "npu"


def _load() -> ModuleType | None:
    global _module, _import_error
    if _module is not None or _import_error is not None:
        return _module
    try:
        _module = importlib.import_module("torch_npu")
    except ModuleNotFoundError as err:
        if err.name not in (None, "torch_npu"):
            # torch_npu exists but one of its own imports is missing.
            _import_error = f"torch_npu is installed but failed to import ({err}); {_SET_ENV_HINT}"
        else:
            _import_error = (
                "torch_npu is not installed: `pip install 'portarl[npu]'` (a torch-npu release "
                f"matching torch {torch.__version__}) on a machine with CANN"
            )
    except (ImportError, OSError) as err:
        _import_error = f"torch_npu failed to import ({err}): the CANN environment is not sourced; {_SET_ENV_HINT}"
    except RuntimeError as err:
        _import_error = _runtime_error_reason(err)
    return _module


def _runtime_error_reason(err: RuntimeError) -> str:
    """One line for a RuntimeError raised by ``import torch_npu``.

    torch_npu (2.13, ``torch_npu/__init__.py``) refuses a torch built for another
    accelerator with "Two accelerators cannot be used at the same time in PyTorch: npu and
    cuda. ..." plus an error-code line; the fix is the CPU build of torch that torch-npu pins.
    """
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "Two accelerators" in first:
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "another accelerator"
        return (f"torch_npu cannot load into this torch {torch.__version__} (built for {built}): it needs the CPU "
                "build of the torch release its torch-npu pins; install that torch (`pip install 'portarl[npu]'`), "
                "or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to use the other device without torch_npu")
    return f"torch_npu failed to import (RuntimeError: {first}); {_SET_ENV_HINT}"


def unavailable_reason() -> str | None:
    """None when an NPU is usable, else why not and what to do."""
    module = _load()
    if module is None:
        return _import_error
    if device_type != "npu":
        return None
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        where = f" (ASCEND_RT_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"torch_npu imported but no NPU is visible{where}: check `npu-smi info` and the device mounts"
    return None


def device_count() -> int:
    if _load() is None or device_type != "npu":
        return 0
    return torch.npu.device_count()


def set_device(index: int) -> None:
    """Pin this process to NPU ``index`` (distributed ranks)."""
    if _load() is None:
        raise RuntimeError(_import_error)
    torch.npu.set_device(index)


def synchronize() -> None:
    """Wait for queued NPU work (timing). No-op for a CPU stand-in."""
    if _load() is not None and device_type == "npu":
        torch.npu.synchronize()


def masked_logit(n_cols: int) -> float:
    """The finite fp32 value fed to the operator in place of a -inf logit (a masked vocabulary).

    Why not -inf: the operator's label-smoothing term sums a row's log-probs, and on some
    implementations it is computed even at ``label_smoothing=0``, so a -inf entry gives
    0 * inf = NaN for the whole row (unknown on Ascend; cheap to make impossible). Why not
    the lowest finite fp32 either: two such log-probs already sum to -inf. fp32's lowest
    finite value divided by ``2 * n_cols`` keeps the row's sum finite, and is still so far
    below any real logit that its probability is exactly 0, as exp(-inf) is.
    """
    return torch.finfo(torch.float32).min / (2 * max(1, n_cols))


def cross_entropy_loss(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(loss, log_prob)`` from ``npu_cross_entropy_loss(reduction="none")``.

    ``logits`` fp32 [N, C] (portarl feeds fp32 chunks: fp32 results). ``ignore_index=-1``
    (negative) ignores nothing: callers mask padded rows themselves and keep their targets
    in range. Only ``loss`` carries a gradient.

    -inf logits never reach the operator: they go in as :func:`masked_logit` (probability
    exactly 0 and no gradient, as for -inf), and a row whose target sits on a -inf logit
    gets ``loss = +inf`` (logp = -inf, the op contract) instead of the clamp's finite
    number; in ``log_prob`` masked entries hold a large negative finite value (exp() is 0).
    NaN and +inf pass through unchanged.
    """
    module = _load()
    if module is None:
        raise RuntimeError(_import_error)
    if logits.dtype != torch.float32:
        raise ValueError(f"cross_entropy_loss: logits must be float32 (got {logits.dtype}); portarl feeds fp32 chunks")
    finite = logits.clamp(min=masked_logit(logits.shape[-1]))
    loss, log_prob, _zloss, _lse = module.npu_cross_entropy_loss(
        finite, target, reduction="none", ignore_index=-1
    )
    on_masked = torch.isneginf(logits.detach().gather(-1, target.unsqueeze(-1)).squeeze(-1))
    return torch.where(on_masked, float("inf"), loss), log_prob


def fused_adamw_reason() -> str | None:
    """None when ``torch.optim.AdamW(fused=True)`` can run on the NPU, else why not.

    torch accepts its out-of-tree accelerator for fused AdamW (``torch.utils._foreach_utils.
    _get_fused_kernels_supported_devices`` lists the privateuse1 backend, ``npu`` once
    torch_npu renamed it), and the step calls ``aten::_fused_adamw_``. Checked in the
    shipped op schemas (``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``, read
    from the PyPI wheels without CANN): torch-npu 2.13.0 and 2.10.0.post4 register
    ``_fused_adamw_`` (float lr; not its ``.tensor_lr`` overload, which portarl's float
    learning rates never call). At run time the dispatcher says whether this torch_npu
    registered the kernel for the NPU (PrivateUse1).
    """
    module = _load()
    if module is None:
        return _import_error
    if device_type != "npu":
        return None  # a stand-in serving CPU tensors: torch's own CPU kernel runs
    if torch._C._get_privateuse1_backend_name() != "npu":
        return "torch_npu did not register the npu device with torch"
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_adamw_", "PrivateUse1"):
        return (f"torch_npu {getattr(module, '__version__', '?')} registers no _fused_adamw_ kernel for the NPU "
                "(its op schemas list none)")
    return None


#: torch_npu's option names behind the precision switches portarl records and holds, with
#: the value torch_npu reports when the option was never set. Read and written the way
#: torch_npu's own properties do (``torch_npu/npu/npu_config.py``: ``_npu_getOption`` /
#: ``_npu_setOption``); ``torch.npu.config.allow_internal_format`` has a setter but no
#: getter in torch_npu 2.13, so the option is the only way to read it.
PRECISION_OPTIONS = {
    "npu.allow_internal_format": ("ALLOW_INTERNAL_FORMAT", False),  # NZ weight format; vllm-ascend sets it
    "npu.matmul.allow_hf32": ("ALLOW_MATMUL_HF32", False),
    "npu.conv.allow_hf32": ("ALLOW_CONV_HF32", True),
}


def precision_switches() -> dict[str, bool]:
    """The NPU precision switches of this process (:data:`PRECISION_OPTIONS`); empty off an NPU."""
    module = _load()
    if module is None or device_type != "npu":
        return {}
    out = {}
    for name, (option, default) in PRECISION_OPTIONS.items():
        raw = module._C._npu_getOption(option)
        text = raw.decode() if isinstance(raw, bytes) else (raw or "")
        out[name] = default if text == "" else text == "enable"
    return out


def set_precision_switch(name: str, value: bool) -> None:
    """Set one of :data:`PRECISION_OPTIONS` (as ``torch.npu.config`` / ``torch.npu.matmul`` do)."""
    module = _load()
    if module is None:
        raise RuntimeError(_import_error)
    module._C._npu_setOption({PRECISION_OPTIONS[name][0]: "enable" if value else "disable"})


def environment() -> dict[str, str | None]:
    """torch_npu, CANN and driver versions and the device name, for parity reports."""
    module = _load()
    info: dict[str, str | None] = {"torch_npu": None, "cann": None, "npu_driver": None, "npu_name": None}
    if module is None or device_type != "npu":
        return info
    info["torch_npu"] = getattr(module, "__version__", None)
    info["cann"] = getattr(torch.version, "cann", None)
    with contextlib.suppress(Exception):
        from torch_npu.npu.utils import get_cann_version  # type: ignore[import-not-found]

        info["cann"] = get_cann_version(module="CANN") or info["cann"]
        info["npu_driver"] = get_cann_version(module="DRIVER") or None
    with contextlib.suppress(Exception):
        info["npu_name"] = torch.npu.get_device_name(0)
    return info


@contextlib.contextmanager
def use_module(module: ModuleType, *, serves_device_type: str = "cpu") -> Iterator[None]:
    """Run with ``module`` in place of torch_npu (tests: a CPU stand-in). Not for hardware."""
    global _module, _import_error, device_type
    saved = (_module, _import_error, device_type)
    _module, _import_error, device_type = module, None, serves_device_type
    try:
        yield
    finally:
        _module, _import_error, device_type = saved


def reset() -> None:
    """Forget the cached import result (tests that simulate import failures)."""
    global _module, _import_error
    _module, _import_error = None, None
