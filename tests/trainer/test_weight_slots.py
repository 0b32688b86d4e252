"""portarl.trainer.asynchronous.weights.WeightSlots: the async trainer's published versions
rotate through a few files written once and then overwritten in place (no fresh file, so no
fresh pages, per version); each file reads back as exactly the version written last."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from portarl.trainer.asynchronous.weights import WeightSlots


def _state(seed: int, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(7, 3, generator=g).to(dtype), "norm.weight": torch.randn(3, generator=g).to(dtype),
            "step": torch.tensor(seed)}


def test_versions_rotate_through_the_slots_in_place(tmp_path):
    slots = WeightSlots(tmp_path, 2)
    try:
        inodes = {}
        for version in range(5):
            assert slots.occupant(version) == (version - 2 if version >= 2 else None)
            path = slots.write(_state(version), version)
            assert path == tmp_path / f"weights-slot{version % 2}.safetensors"
            inodes.setdefault(path, path.stat().st_ino)
            assert path.stat().st_ino == inodes[path], "the slot was replaced, not overwritten"
            got = load_file(str(path))
            assert got.keys() == _state(version).keys()
            for name, tensor in _state(version).items():
                assert torch.equal(got[name], tensor), (version, name)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["weights-slot0.safetensors", "weights-slot1.safetensors"]
    finally:
        slots.close()


def test_a_new_layout_rewrites_the_slot(tmp_path):
    """Another dtype (or shape, or name) than the slot was made for: a new file, exact again."""
    slots = WeightSlots(tmp_path, 1)
    try:
        slots.write(_state(0), 0)
        path = slots.write(_state(1, torch.bfloat16), 1)
        for name, tensor in _state(1, torch.bfloat16).items():
            assert torch.equal(load_file(str(path))[name], tensor), name
        slots.write(_state(2, torch.bfloat16), 2)
        assert torch.equal(load_file(str(path))["norm.weight"], _state(2, torch.bfloat16)["norm.weight"])
    finally:
        slots.close()
