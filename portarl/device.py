"""The device flag: turn "auto" | "cuda" | "npu" | "cpu" | torch.device into a usable device.

``auto`` prefers CUDA, then an Ascend NPU, then the CPU. An explicit device that is not
usable raises :class:`DeviceUnavailableError` saying what is missing and how to fix it,
rather than quietly running somewhere else.
"""

from __future__ import annotations

import torch

from portarl.backends.npu import torch_npu_api

DEVICE_CHOICES = ("auto", "cuda", "npu", "cpu")


class DeviceUnavailableError(RuntimeError):
    """An explicitly requested device cannot be used on this machine."""


def cuda_unavailable_reason() -> str | None:
    """None when CUDA is usable, else a sentence saying why not and what to do."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (
            f"this torch build ({torch.__version__}) has no CUDA support: install a CUDA build "
            "of torch (https://pytorch.org/get-started/locally/)"
        )
    return (
        "torch has CUDA support but sees no GPU: check `nvidia-smi`, the driver, and "
        "CUDA_VISIBLE_DEVICES"
    )


def _check_index(kind: str, index: int | None, count: int) -> None:
    if index is not None and index >= count:
        raise DeviceUnavailableError(
            f"device {kind}:{index} requested but only {count} {kind} device(s) are visible"
            + (f" (indices 0..{count - 1})" if count else "")
        )


def _parse(text: str, original) -> tuple[str, int | None]:
    """'cuda' -> ('cuda', None), 'npu:1' -> ('npu', 1). Parsed here because torch only knows
    the 'npu' device type once torch_npu is imported, and a missing torch_npu must give the
    install hint, not a parse error."""
    kind, _, index = text.partition(":")
    if kind not in DEVICE_CHOICES[1:] or (index and not index.isdigit()):
        raise ValueError(
            f"device={original!r} is not a device; use one of {', '.join(DEVICE_CHOICES)} "
            "(optionally with an index, e.g. 'cuda:1')"
        )
    return kind, int(index) if index else None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Return the torch.device to run on.

    Args:
        device: ``"auto"`` (cuda, then npu, then cpu), ``"cuda"``, ``"cuda:1"``, ``"npu"``,
            ``"npu:0"``, ``"cpu"``, or a ``torch.device``.

    Raises:
        ValueError: ``device`` is not one of the accepted forms.
        DeviceUnavailableError: an explicit device is absent; the message names what is
            missing (torch_npu not installed, CANN environment not sourced, no visible device).
    """
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
        if kind not in DEVICE_CHOICES[1:]:
            raise ValueError(f"device={device!r}: portarl runs on {', '.join(DEVICE_CHOICES[1:])}; {kind!r} is not supported")
    elif isinstance(device, str):
        text = device.strip().lower()
        if text == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            if torch_npu_api.unavailable_reason() is None:
                return torch.device("npu", 0)
            return torch.device("cpu")
        kind, index = _parse(text, device)
    else:
        raise ValueError(
            f"device must be a string ({', '.join(DEVICE_CHOICES)}) or a torch.device, "
            f"got {type(device).__name__}"
        )

    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise DeviceUnavailableError(f"device {device!s} requested but {reason}")
        _check_index(kind, index, torch.cuda.device_count())
        return torch.device("cuda", index if index is not None else torch.cuda.current_device())
    reason = torch_npu_api.unavailable_reason()
    if reason is not None:
        raise DeviceUnavailableError(f"device {device!s} requested but {reason}")
    _check_index(kind, index, torch_npu_api.device_count())
    return torch.device("npu", index if index is not None else 0)
