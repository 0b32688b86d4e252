"""Trainer state on disk without pickle: tensors in safetensors, everything else in JSON.

Why: a checkpoint is shared between people and machines (resume on another node, GPU vs
NPU comparisons), and unpickling one runs whatever code its author put in it. Neither
safetensors nor JSON can describe code, so reading a planted file can only fail (with a
message naming the file), never execute.

The nested state (optimizer and scheduler ``state_dict``s, loss-scale state and fp32 master
weights, RNG states, guard histories, config) is split in two files:

- ``trainer_state.safetensors``: every tensor, under a generated key ``t<N>``;
- ``trainer_state.json``: the structure, with ``{"__tensor__": "t<N>"}`` where a tensor was,
  ``{"__tuple__": [...]}`` for tuples and ``{"__dict__": [[key, value], ...]}`` for mappings
  whose keys are not all strings (optimizer state is keyed by parameter index).

RNG states are plain data: Python's as lists, numpy's Mersenne-Twister key as a uint32
tensor plus its position and Gaussian cache, torch's as its byte tensor.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from portarl.runtime.distributed import full

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
FORMAT = 1


class UnsafeStateError(ValueError):
    """A state file is not what portarl writes (tampered, foreign or corrupt); names the file."""


# ------------------------------------------------------------------ RNG states, as plain data
def rng_state() -> dict:
    kind, key, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "key": torch.from_numpy(np.asarray(key, dtype=np.uint32).copy()), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_global_rngs(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators from ``train.seed``. portarl
    samples from generators of its own and never draws from these, but user code does (a
    reward that calls ``random.random()`` or ``torch.rand``), and they start from the OS's
    entropy (torch 2.13 seeds its default generator at start too): without this, two runs
    with one config differ wherever such code draws. A resumed run sets them back to the
    checkpoint's states instead (:func:`set_rng_state`)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's default generator as well


def set_rng_state(state: dict) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    np.random.set_state((npy["kind"], np.asarray(npy["key"].numpy(), dtype=np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------ encode / decode
def _encode(value, tensors: dict, seen: dict):
    if isinstance(value, torch.Tensor):
        t = full(value.detach()).cpu().contiguous()  # a DTensor: its full value
        # safetensors refuses tensors sharing memory (tied weights): store a copy of repeats.
        ptr = (t.data_ptr(), t.numel(), t.dtype) if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen[ptr] = True
        key = f"t{len(tensors)}"
        tensors[key] = t
        return {"__tensor__": key}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value  # json writes NaN / Infinity and reads them back
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, seen) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors, seen) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, tensors, seen) for k, v in value.items()}
        return {"__dict__": [[_encode(k, tensors, seen), _encode(v, tensors, seen)] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    raise TypeError(f"trainer state holds a {type(value).__name__}, which portarl does not store "
                    f"(only tensors, numbers, strings, lists, tuples, dicts)")


def _decode(value, tensors: dict, where: Path):
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, inner), = value.items()
        if tag == "__tensor__":
            if inner not in tensors:
                raise UnsafeStateError(f"{where}: refers to tensor {inner!r}, which {STATE_TENSORS} does not hold")
            return tensors[inner]
        if tag == "__tuple__":
            return tuple(_decode(v, tensors, where) for v in inner)
        if tag == "__dict__":
            return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in inner}
        if tag == "__dtype__":
            dtype = getattr(torch, str(inner), None)
            if not isinstance(dtype, torch.dtype):
                raise UnsafeStateError(f"{where}: {inner!r} is not a torch dtype")
            return dtype
    return {k: _decode(v, tensors, where) for k, v in value.items()}


def save_state(state: dict, directory: Path) -> list[Path]:
    """Write ``state`` as ``trainer_state.json`` + ``trainer_state.safetensors``; returns both paths."""
    from safetensors.torch import save_file

    tensors: dict = {}
    tree = _encode(state, tensors, {})
    json_path, tensor_path = directory / STATE_JSON, directory / STATE_TENSORS
    save_file(tensors, str(tensor_path))
    json_path.write_text(json.dumps({"format": FORMAT, "state": tree}))
    return [json_path, tensor_path]


def load_state(directory: Path) -> dict:
    """Read the state written by :func:`save_state`. Never unpickles: a file that is not the
    JSON / safetensors portarl writes raises :class:`UnsafeStateError` naming it."""
    from safetensors.torch import load_file

    json_path, tensor_path = directory / STATE_JSON, directory / STATE_TENSORS
    for path in (json_path, tensor_path):
        if not path.is_file():
            legacy = " (a checkpoint from an older portarl: its trainer_state.pt is a pickle, which portarl no " \
                     "longer loads; start without --resume)" if (directory / "trainer_state.pt").exists() else ""
            raise UnsafeStateError(f"checkpoint {directory}: {path.name} is missing{legacy}")
    try:
        doc = json.loads(json_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnsafeStateError(f"checkpoint file {json_path} is not portarl's JSON trainer state ({err}); "
                               f"refusing it (portarl never unpickles)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "state" not in doc:
        raise UnsafeStateError(f"checkpoint file {json_path} is not portarl's trainer state (format {FORMAT})")
    try:
        tensors = load_file(str(tensor_path))
    except Exception as err:  # safetensors raises its own error types for a bad header
        raise UnsafeStateError(f"checkpoint file {tensor_path} is not a valid safetensors file ({err})") from None
    return _decode(doc["state"], tensors, json_path)
