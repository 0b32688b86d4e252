"""Checkpoints load no pickle, verify against their manifest, fall back past damaged ones,
and prune safely (issue 12, items 1 and 2)."""

from __future__ import annotations

import logging
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from portarl.trainer.checkpoint import CheckpointError, CheckpointManager, UnsafeStateError, rng_state, set_rng_state
from portarl.trainer.checkpoint import manifest as mf
from portarl.trainer.checkpoint import safe_state
from portarl.trainer.run.persistence import trainer_state


class _Payload:
    """Unpickling this creates ``marker``: proof that code ran on load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _plant(path: Path, marker: Path, *, rehash: bool) -> None:
    """Replace ``path`` by a code-running pickle; with ``rehash`` also rewrite the manifest and
    COMPLETE to match (an attacker who can write the whole directory)."""
    path.write_bytes(pickle.dumps(_Payload(marker)))
    if rehash:
        directory = next(p for p in [path.parent, path.parent.parent] if (p / mf.COMPLETE).exists())
        step = int(directory.name.split("-")[1])
        mf.write_complete(directory, step, mf.write_manifest(directory, step))


@pytest.fixture
def trained(make_trainer):
    """A 3-step run with a checkpoint after every step (keep_last=3)."""
    trainer = make_trainer("train.steps=3", "checkpoint.every=1", "checkpoint.keep_last=3")
    trainer.train()
    return trainer


def test_checkpoint_holds_no_pickle_and_round_trips(trained):
    ckpt = trained.checkpoints.latest()
    names = {p.name for p in ckpt.iterdir()}
    assert {"model.safetensors", "trainer_state.json", "trainer_state.safetensors", "MANIFEST.json", "COMPLETE"} <= names
    assert not [n for n in names if n.endswith((".pt", ".pkl", ".bin"))]
    state = CheckpointManager.load_state(ckpt)
    want = trainer_state(trained)
    assert state["step"] == 3 and state["config"] == want["config"]
    for pid, slots in want["optimizer"]["state"].items():  # int keys and every tensor survive
        for key, value in slots.items():
            assert torch.equal(state["optimizer"]["state"][pid][key], value)
    assert state["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert state["scheduler"] == want["scheduler"]
    assert state["kl_spikes"] == want["kl_spikes"]


def test_rng_states_are_plain_data_and_restore_exactly(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's state
    safe_state.save_state({"rng": rng_state()}, tmp_path)
    want = (random.random(), np.random.standard_normal(), np.random.random(), torch.rand(3))
    set_rng_state(safe_state.load_state(tmp_path)["rng"])
    got = (random.random(), np.random.standard_normal(), np.random.random(), torch.rand(3))
    assert got[:3] == want[:3] and torch.equal(got[3], want[3])


@pytest.mark.parametrize("name", ["trainer_state.json", "trainer_state.safetensors", "model.safetensors"])
def test_planted_pickle_is_refused_and_never_runs(trained, tmp_path, name):
    ckpt = trained.checkpoints.latest()
    marker = tmp_path / f"ran-{name}"
    # Not re-hashed: the manifest refuses it before anything is parsed.
    _plant(ckpt / name, marker, rehash=False)
    with pytest.raises(CheckpointError, match=f"{ckpt.name}: {name} (has .* bytes|does not match)"):
        CheckpointManager.load_state(ckpt)
    # Re-hashed (manifest and COMPLETE rewritten too): the loaders still never unpickle.
    _plant(ckpt / name, marker, rehash=True)
    with pytest.raises((UnsafeStateError, CheckpointError), match=name):
        CheckpointManager.load_state(ckpt)
        CheckpointManager.load_weights(trained.model, ckpt)
    assert not marker.exists(), "the planted pickle ran"


def test_legacy_pickle_state_is_never_loaded(trained, tmp_path):
    ckpt = trained.checkpoints.latest()
    marker = tmp_path / "ran"
    (ckpt / "trainer_state.json").unlink()
    _plant(ckpt / "trainer_state.pt", marker, rehash=True)
    with pytest.raises(UnsafeStateError, match="trainer_state.json is missing.*pickle"):
        CheckpointManager.load_state(ckpt)
    assert not marker.exists()


def _zero(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(data))


def _random(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = os.urandom(64)
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {"zeroed": _zero, "random": _random, "truncated": _truncate, "missing": Path.unlink}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_falls_back_to_newest_that_verifies(trained, make_trainer, caplog, damage):
    root = trained.checkpoints.root
    DAMAGE[damage](root / "step-000003" / "model.safetensors")
    with pytest.raises(CheckpointError, match="step-000003: model.safetensors"):
        mf.verify(root / "step-000003")
    expected = CheckpointManager.load_state(root / "step-000002")
    fresh = make_trainer("train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=1")
    with caplog.at_level(logging.WARNING, logger="portarl.train"):
        assert fresh.resume() == 2
    assert "step-000003: model.safetensors" in caplog.text
    assert "falling back to" in caplog.text and "step-000002" in caplog.text
    # the damaged one was moved aside: never loaded again, never counted by pruning
    assert not (root / "step-000003").exists() and list(root.glob("corrupt-step-000003-*"))
    for key, value in expected["optimizer"]["state"][0].items():
        assert torch.equal(fresh.optimizer.state_dict()["state"][0][key], value)
    fresh.train(resume=True)  # continues to step 4; keep_last=1 prunes down to it
    assert [p.name for p in fresh.checkpoints.complete()] == ["step-000004"]
    mf.verify(root / "step-000004")


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.safetensors"])
def test_a_file_that_matches_its_manifest_but_cannot_be_read_falls_back_too(trained, make_trainer, caplog, name):
    """Every checkpoint file follows one rule (issue 33 item 5): a forged manifest vouches for
    bytes that are no safetensors file; resume moves that checkpoint aside and falls back,
    with the weights and optimizer state of the step it falls back to."""
    from safetensors.torch import load_file

    root = trained.checkpoints.root
    target = root / "step-000003" / name
    target.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json" + os.urandom(256))
    mf.write_complete(root / "step-000003", 3, mf.write_manifest(root / "step-000003", 3))
    mf.verify(root / "step-000003")  # the manifest matches: only reading it shows the damage
    weights = load_file(str(root / "step-000002" / "model.safetensors"))
    fresh = make_trainer("train.steps=4", "checkpoint.every=1")
    with caplog.at_level(logging.WARNING, logger="portarl.train"):
        assert fresh.resume() == 2
    unusable = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint unusable"))
    assert "step-000003" in unusable and name in unusable and "falling back to" in caplog.text
    assert not (root / "step-000003").exists() and list(root.glob("corrupt-step-000003-*"))
    live = fresh.model.state_dict()
    assert all(torch.equal(live[k], v) for k, v in weights.items())
    fresh.train(resume=True)
    assert fresh.checkpoints.latest().name == "step-000004"


def test_no_verified_checkpoint_stops_clearly(trained, make_trainer):
    for ckpt in trained.checkpoints.complete():
        _truncate(ckpt / "trainer_state.safetensors")
    fresh = make_trainer("train.steps=4")
    with pytest.raises(CheckpointError, match="no checkpoint in .* verifies") as err:
        fresh.resume()
    assert str(err.value).count("trainer_state.safetensors has") == 3


def test_prune_removes_complete_first_and_reports_failures(trained, monkeypatch, caplog):
    manager = CheckpointManager(trained.output_dir, keep_last=1)
    newest = manager.latest()

    def failing_rmtree(path, onerror=None, **kwargs):
        onerror(os.rmdir, str(path), (OSError, OSError(13, "Permission denied"), None))

    monkeypatch.setattr(mf.shutil, "rmtree", failing_rmtree)
    with caplog.at_level(logging.INFO, logger="portarl.train"):
        manager.prune(protect=newest)
    assert "could not remove all of" in caplog.text and "Permission denied" in caplog.text
    assert "pruning: removed" not in caplog.text
    # the marker went first: what is left is not taken for a checkpoint
    assert manager.complete() == [newest]
    assert (trained.checkpoints.root / "step-000001" / "model.safetensors").exists()


def test_prune_never_removes_the_checkpoint_just_written(trained):
    root = trained.checkpoints.root
    manager = CheckpointManager(trained.output_dir, keep_last=1)
    manager.prune(protect=root / "step-000002")  # e.g. re-saved after falling back past step 3
    assert [p.name for p in manager.complete()] == ["step-000002", "step-000003"]


def test_sharded_checkpoint_verified_before_dcp_reads_metadata(make_trainer, tmp_path):
    """DCP unpickles ``.metadata``: a planted one, or a foreign file, is refused first."""
    from portarl.runtime.distributed import SINGLE

    trainer = make_trainer("train.steps=1")
    manager = CheckpointManager(tmp_path / "sharded")
    path = manager.save_sharded(1, trainer.model, trainer.optimizer, None, {"step": 1}, SINGLE)
    CheckpointManager.load_sharded(path, trainer.model, trainer.optimizer)  # intact: loads
    marker = tmp_path / "ran"
    _plant(path / "dcp" / ".metadata", marker, rehash=False)
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata (has .* bytes|does not match)"):
        CheckpointManager.load_sharded(path, trainer.model, trainer.optimizer)
    path2 = manager.save_sharded(2, trainer.model, trainer.optimizer, None, {"step": 2}, SINGLE)
    (path2 / "dcp" / "__9_0.distcp").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match=r"dcp/__9_0.distcp is not in the manifest"):
        CheckpointManager.load_sharded(path2, trainer.model, trainer.optimizer)
    assert not marker.exists()


def test_sharded_metadata_is_unpickled_with_an_allow_list(make_trainer, tmp_path):
    """Even with the manifest rewritten to match, DCP's pickles cannot run code: ``.metadata``
    goes through an allow-list unpickler, non-tensor items through weights_only=True."""
    from portarl.runtime.distributed import SINGLE
    from portarl.trainer.checkpoint.safe_dcp import load_metadata_safely

    trainer = make_trainer("train.steps=1")
    path = CheckpointManager(tmp_path / "sharded").save_sharded(1, trainer.model, trainer.optimizer, None, {"step": 1},
                                                                SINGLE)
    metadata = load_metadata_safely((path / "dcp" / ".metadata").read_bytes(), "x")  # the real one passes
    assert "model.model.embed_tokens.weight" in metadata.state_dict_metadata
    marker = tmp_path / "ran"
    _plant(path / "dcp" / ".metadata", marker, rehash=True)
    mf.verify(path)  # the manifest was forged to match
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata refers to pathlib.Path.touch"):
        CheckpointManager.load_sharded(path, trainer.model, trainer.optimizer)
    assert not marker.exists()


def test_cleanup_reports_what_it_could_not_remove(trained, monkeypatch, caplog):
    root = trained.checkpoints.root
    partial = root / ".tmp-step-000009-1"
    (partial / "sub").mkdir(parents=True)

    def failing_rmtree(path, onerror=None, **kwargs):
        onerror(os.rmdir, str(path), (OSError, OSError(16, "Device or resource busy"), None))

    monkeypatch.setattr(mf.shutil, "rmtree", failing_rmtree)
    with caplog.at_level(logging.WARNING, logger="portarl.train"):
        assert CheckpointManager(trained.output_dir).clean_partial() == []  # not reported as removed
    assert "could not remove the incomplete checkpoint" in caplog.text and "busy" in caplog.text


def test_a_step_saved_again_keeps_the_checkpoint_this_run_wrote_or_resumed_from(trained):
    """A run saves a step once more only when it stops during the next one, holding less
    than at the step's end (async mode: no batches in flight): the complete checkpoint is
    kept, not rewritten."""
    root = trained.checkpoints.root
    written = (root / "step-000003" / mf.COMPLETE).stat()
    assert trained.save_checkpoint() == root / "step-000003"
    again = (root / "step-000003" / mf.COMPLETE).stat()
    assert (again.st_ino, again.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    resumed = CheckpointManager(trained.output_dir)  # a later run that resumed from it
    assert resumed.kept(3) is None
    directory, _ = resumed.load_newest_verified()
    assert resumed.kept(3) == directory == root / "step-000003"


def test_resaving_a_step_never_leaves_it_missing(trained):
    root = trained.checkpoints.root
    trained.checkpoints.intact.clear()  # step 3 again, by a run that did not write it nor verify it
    trained.save_checkpoint()
    mf.verify(root / "step-000003")
    assert not list(root.glob(".replaced-*")) and not list(root.glob(".tmp-*"))
    # A kill after the old copy was moved aside and before the new one took its place:
    os.rename(root / "step-000003", root / ".replaced-step-000003")
    assert CheckpointManager(trained.output_dir).clean_partial() == []
    mf.verify(root / "step-000003")  # restored, whole
