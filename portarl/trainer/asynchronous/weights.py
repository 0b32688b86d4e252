"""The policy's weights as a separate rollout process loads them (``rollout.mode: async``).

The rollout worker holds a plain copy of the base model (no adapters, not sharded) and
loads each published version with ``safetensors.torch.load_model(strict=True)``: every
name and shape is checked. What the trainer holds differs in three ways, each handled
here and nowhere else:

- **FSDP2 (torchrun)**: every parameter is a DTensor shard. Each is gathered with
  ``full_tensor()``, a collective, so *every rank* calls :func:`rollout_state_dict` at the
  same point, in the same order; only rank 0 keeps the full tensors (the others get
  ``None``), one tensor at a time, so no rank ever holds more than one extra full tensor.
- **LoRA**: the adapter is folded in on the side (:func:`portarl.assets.lora.merged_tensors`,
  ``W + scaling * B @ A`` summed in fp32), under the base model's names; the training
  model is never merged in place. Under FSDP2 each adapted weight is folded from its
  gathered base weight and gathered ``lora_A`` / ``lora_B``, one layer at a time: the
  merged weights of one process holding the same full weights, bitwise.
- **Tied weights** (the output head sharing the embedding): written once, under the first
  name (``load_model`` fills the tied twin); a gathered or merged state dict no longer
  shares the storage ``safetensors.torch.save_model`` would detect.

Floating-point tensors are written in the rollout's dtype (``precision.dtype``): FSDP2 keeps
fp32 parameters under a bf16 / fp16 compute policy and casts them for every forward; the
cast here rounds the same way (round to nearest even), so the worker samples the weights
the trainer's own forward would use. On one process the model already has that dtype and
the tensors are written unchanged (bitwise: the staleness-0 equivalence depends on it).

Publishing every step (:class:`WeightSlots`): a fresh file per version cost the kernel a
fresh page per 4 KiB of weights each time (SmolLM2-135M's 540 MB: 0.15-1.3 s of CPU per
version, measured); the versions in flight instead rotate through ``max_staleness + 1``
files that are created once and overwritten in place (one memory copy into the file's
existing pages: about 0.05 s). A slot is rewritten only after the worker has loaded the version it held (its
``loaded`` reply; the schedule guarantees it before the slot comes round again, and
:meth:`portarl.trainer.asynchronous.pipeline.AsyncRollout._publish` waits for it otherwise).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from portarl.assets.lora import base_model, merged_tensors
from portarl.trainer.run.write_failure import writing


def tied_twins(model: torch.nn.Module) -> set[str]:
    """Names (base-model names) of parameters that are the same tensor as an earlier one."""
    inner = base_model(model)
    seen: dict[int, str] = {}
    twins = set()
    for name, param in inner.named_parameters(remove_duplicate=False):
        name = ".".join(p for p in name.split(".") if p != "base_layer")
        if id(param) in seen:
            twins.add(name)
        else:
            seen[id(param)] = name
    return twins


def frozen_names(model: torch.nn.Module) -> set[str]:
    """Base-model names of the parameters no optimizer step changes (``requires_grad``
    false: a vision-language model's frozen vision tower). After a worker has loaded one
    whole version, later versions leave these out: the tower is sent once, not at every
    step (:func:`portarl.rollout.weight_sync.inbox.load_version` and the worker's file
    load accept exactly these as missing)."""
    from portarl.assets.lora import is_lora

    if is_lora(model):  # the base weights are frozen by LoRA itself and folded into every version
        return set()
    return {name for name, p in base_model(model).named_parameters() if not p.requires_grad}


def rollout_tensors(model: torch.nn.Module, dtype: torch.dtype, is_main: bool = True, device="cpu",
                    skip: frozenset | set = frozenset()):
    """Yield ``(name, tensor)`` (contiguous, on ``device``) for the worker's plain model, one
    tensor at a time, on the rank with ``is_main``; yield nothing elsewhere. Collective under
    FSDP2: every rank must run it to the end, in step (a rank that stops early leaves the
    others inside a gather: :func:`drain`). ``device``: where the receiving end wants the
    tensors (the host for a file or Gloo; the trainer's device for NCCL / HCCL, so a tensor
    never makes the round trip through host memory). ``skip``: further names left out
    (:func:`frozen_names`, once the worker holds them)."""
    for name, t in merged_tensors(model, skip=tied_twins(model) | set(skip)):  # each gathered whole (collective)
        if not is_main:
            continue
        if t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        yield name, t.to(device).contiguous()


def drain(items) -> None:
    """Run ``items`` (a :func:`rollout_tensors` generator) to its end, discarding what it
    yields: the rest of its gathers, which the other ranks are waiting in."""
    for _ in items:
        pass


def rollout_state_dict(model: torch.nn.Module, dtype: torch.dtype, is_main: bool = True,
                       skip: frozenset | set = frozenset()) -> dict | None:
    """``{name: tensor}`` (contiguous, on the CPU) for the worker's plain model, on the rank
    with ``is_main``; ``None`` elsewhere. Collective under FSDP2: every rank must call it."""
    items = rollout_tensors(model, dtype, is_main, skip=skip)
    if not is_main:
        drain(items)
        return None
    return dict(items)


def write_rollout_weights(model: torch.nn.Module, dtype: torch.dtype, path: Path, is_main: bool = True) -> bool:
    """Write :func:`rollout_state_dict` to ``path`` atomically (temporary name, then rename)
    on the main rank; returns whether this rank wrote. Collective under FSDP2."""
    from safetensors.torch import save_file

    state = rollout_state_dict(model, dtype, is_main)
    if state is None:
        return False
    tmp = Path(path).with_suffix(".tmp")
    with writing(tmp):
        save_file(state, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
    return True


class WeightSlots:
    """``count`` safetensors files in ``directory``, version v written into slot v % count:
    created by ``save_file`` the first time (or when the names, dtypes or shapes change),
    then overwritten in place, each tensor's bytes at its offset (``os.pwrite`` into the
    file's existing pages: not mapped, so they do not count in the trainer's resident set).
    The caller makes sure the reader is done with a slot before it comes round again.

    A write that fails (disk full, a file-size limit, no permission) is a
    :class:`~portarl.trainer.run.write_failure.WriteFailed` naming the slot file: ``portarl
    train`` ends with its one line and exit 4, as for a checkpoint that cannot be written."""

    def __init__(self, directory: Path, count: int):
        if count < 1:
            raise ValueError(f"WeightSlots needs at least one slot, got {count}")
        self.dir, self.count = Path(directory), count
        self._files: dict[int, tuple] = {}  # slot -> (fd, {name: byte offset}, layout)
        self._versions: dict[int, int] = {}  # slot -> the version written into it last

    def occupant(self, version: int) -> int | None:
        """The version in the slot ``version`` would overwrite (None: the slot is unused)."""
        return self._versions.get(version % self.count)

    def path(self, version: int) -> Path:
        return self.dir / f"weights-slot{version % self.count}.safetensors"

    def write(self, state: dict, version: int) -> Path:
        """Write ``state`` (contiguous CPU tensors) as ``version``; returns its file."""
        slot, path = version % self.count, self.path(version)
        self._versions[slot] = version
        layout = {name: (str(t.dtype), tuple(t.shape)) for name, t in state.items()}
        opened = self._files.get(slot)
        if opened is None or opened[2] != layout:
            self._close(slot)
            from safetensors.torch import save_file

            tmp = path.with_suffix(".tmp")
            with writing(tmp):  # safetensors reports the system's error only in its message
                save_file(state, str(tmp), metadata={"format": "pt"})
                os.replace(tmp, path)
            self._files[slot] = self._open(path, layout)
            return path
        fd, offsets, _ = opened
        with writing(path):
            for name, tensor in state.items():
                data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                written = 0
                while written < len(data):  # pwrite may write less than asked
                    written += os.pwrite(fd, data[written:], offsets[name] + written)
        return path

    @staticmethod
    def _open(path: Path, layout: dict) -> tuple:
        fd = os.open(path, os.O_RDWR)
        try:
            header_len = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
            header = json.loads(os.pread(fd, header_len, 8))
        except BaseException:
            os.close(fd)
            raise
        offsets = {name: 8 + header_len + entry["data_offsets"][0] for name, entry in header.items()
                   if name != "__metadata__"}
        return fd, offsets, layout

    def _close(self, slot: int) -> None:
        opened = self._files.pop(slot, None)
        if opened is not None:
            os.close(opened[0])

    def close(self) -> None:
        for slot in list(self._files):
            self._close(slot)


__all__ = ["WeightSlots", "drain", "frozen_names", "rollout_state_dict", "rollout_tensors", "tied_twins", "write_rollout_weights"]
