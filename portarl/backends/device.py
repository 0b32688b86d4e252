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


def parse_device(text: str, original=None) -> tuple[str, int | None]:
    """'cuda' -> ('cuda', None), 'npu:1' -> ('npu', 1). Parsed here because torch only knows
    the 'npu' device type once torch_npu is imported, and a missing torch_npu must give the
    install hint, not a parse error."""
    kind, _, index = text.partition(":")
    if kind not in DEVICE_CHOICES[1:] or (index and not index.isdigit()):
        raise ValueError(
            f"device={text if original is None else original!r} is not a device; use one of {', '.join(DEVICE_CHOICES)} "
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
        kind, index = parse_device(text, device)
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


#: The variable that limits which devices a process sees, per device type (torch_npu reads
#: ASCEND_RT_VISIBLE_DEVICES; ../shared/notes/ascend-facts.md).
VISIBLE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def child_placement(device: str, environ: dict[str, str]) -> tuple[str, dict[str, str]]:
    """``(device inside the child, environment variables to set for it)`` for a child
    process (an async rollout worker: ``rollout.worker_devices``) that must run on
    ``device`` as this process numbers it, ``environ`` being this process's environment.

    The child sees only its device: an engine inside it may pick a device on its own (vLLM's
    in-process executor takes the first visible one). ``cuda:N`` becomes
    ``CUDA_VISIBLE_DEVICES`` holding the N-th device this process sees (under an inherited
    ``CUDA_VISIBLE_DEVICES=2,3``, ``cuda:1`` is physical device 3; likewise
    ``ASCEND_RT_VISIBLE_DEVICES`` for ``npu:N``) and the child uses ``cuda:0``. ``cpu``
    changes nothing."""
    kind, index = parse_device(device)
    if kind == "cpu":
        return "cpu", {}
    index = 0 if index is None else index
    variable = VISIBLE_ENV[kind]
    visible = [v.strip() for v in (environ.get(variable) or "").split(",") if v.strip()]
    if visible and index >= len(visible):
        raise ValueError(f"{device} is not visible here ({variable}={environ[variable]} shows {len(visible)} "
                         "device(s), numbered from 0)")
    return f"{kind}:0", {variable: visible[index] if visible else str(index)}




def placed(device) -> tuple[str, int]:
    """``(type, index)`` of a device name, the index 0 where none is given ("cuda" is cuda:0,
    as a process that sees the device uses it)."""
    kind, index = parse_device(str(device))
    return kind, index or 0


def check_worker_devices(worker_devices: list, trainer_device: torch.device, local_ranks: int | None) -> None:
    """Refuse ``rollout.worker_devices`` that a training rank on this node uses: rank 0's
    device, or under torchrun (``local_ranks``: its ranks on this node) devices 0 to
    ``local_ranks - 1`` of rank 0's numbering, one per rank. A worker there would share it
    (two copies of the model, two processes' kernels interleaved) where the setting exists
    to give it a device of its own."""
    if trainer_device.type == "cpu":
        return
    used = [trainer_device.index or 0] if local_ranks is None else list(range(local_ranks))
    taken = [str(d) for d in worker_devices if placed(d) in {(trainer_device.type, i) for i in used}]
    if taken:
        names = ", ".join(f"{trainer_device.type}:{i}" for i in used)
        raise ValueError(f"rollout.worker_devices {taken} are training devices (the trainer's ranks on this node use "
                         f"{names}): give each worker a device no rank trains on, or launch fewer ranks per node")
