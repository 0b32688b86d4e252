"""rollout.weight_sync (issue 36): the async worker gets every weight version over a
weight-sync group of its own with the trainer (``collective``, Gloo on the CPU) or through a
file (``file``); either way the weights it samples with are the trainer's, bitwise, and a
version the trainer stops sending midway is refused whole: the worker keeps its previous
version, the run stops with a checkpoint, and ``--resume`` goes on.

Time: nothing here waits on a fixed deadline; process waits are bounded only by limits
that end a test that has already failed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from portarl.trainer.checkpoint import CheckpointManager
from portarl.trainer.config import ConfigError, TrainConfig
from portarl.trainer.asynchronous.weights import WeightSlots
from portarl.rollout.async_worker import DUMP_ENV
from portarl.trainer.asynchronous.sync import FAULT_ENV as SYNC_FAULT_ENV

import run_guard
from proc_tree import children
from test_async_rollout import _jsonl, _run, _start

HERE = Path(__file__).parent
STANDIN = HERE.parent / "weight_sync"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the worker dies with the trainer on Linux")

#: 10 KiB buckets: the tiny model's version travels in many buckets (a fault can cut one midway)
SMALL_BUCKETS = "rollout.sync_bucket_mb=0.01"


def _device_comm_standin(monkeypatch, log_dir: Path) -> None:
    """``rollout.sync_comm`` resolved to nccl, carried by the STAND-IN of vLLM's communicator
    (tests/weight_sync/standin_vllm.py: bytes over Gloo on the CPU) in the trainer and, through
    its sitecustomize, in the worker: the run's plumbing of the device path, not hardware."""
    sys.path.insert(0, str(STANDIN))
    import standin_vllm

    from portarl.rollout.weight_sync import device_comm
    from portarl.trainer.asynchronous import sync

    for name, module in standin_vllm.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(device_comm, "DeviceStreams", standin_vllm.StandInStreams)
    monkeypatch.setattr(standin_vllm.StandInCommunicator, "log_dir", str(log_dir))
    monkeypatch.setattr(sync, "choose_comm", lambda setting, device, workers: ("nccl", "the stand-in"))
    monkeypatch.setenv("PORTARL_TEST_STANDIN_VLLM", str(log_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDIN / "standin_site"), os.environ["PYTHONPATH"]]))


@pytest.mark.compares_runs
@pytest.mark.parametrize("sync", ["collective", "file", "collective-nccl-standin"])
def test_the_workers_weights_equal_the_trainers_bitwise_at_every_version(tmp_path, monkeypatch, sync):
    from async_capture import capture_async

    dumps = tmp_path / "dumps"
    dumps.mkdir()
    monkeypatch.setenv(DUMP_ENV, str(dumps))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    standin = sync.endswith("-standin")
    if standin:
        _device_comm_standin(monkeypatch, tmp_path)
        sync = "collective"
    if sync == "collective":  # no weights file is written: the versions travel through the group
        def no_file(self, state, version):
            raise AssertionError("rollout.weight_sync=collective wrote a weights file")

        monkeypatch.setattr(WeightSlots, "write", no_file)
    snapshots, batches = capture_async(monkeypatch)
    trainer = _run(tmp_path, "train.steps=3", "rollout.mode=async", f"rollout.weight_sync={sync}", SMALL_BUCKETS,
                   "rewards=[{name: 'trainer_fast:varied_reward'}]")
    assert trainer.step == 3
    reported = sorted({version for _, version, _ in batches})
    loaded = sorted(int(p.stem[1:]) for p in dumps.glob("v*.safetensors"))
    assert reported and set(reported) <= set(loaded), (reported, loaded)
    for version in loaded:
        worker = load_file(dumps / f"v{version}.safetensors")
        ours = snapshots[version]
        assert worker.keys() == ours.keys()
        differ = [name for name in ours if not torch.equal(worker[name], ours[name])]
        assert not differ, f"version {version}: the worker's {differ[:3]} differ from the trainer's"
    # the versions compared moved by training (equal versions would make the check vacuous)
    run_guard.assert_trained(run_guard.grad_norms(tmp_path / "run"), snapshots[0], snapshots[max(loaded)],
                             what=f"the versions sent over {sync}")
    log = (tmp_path / "run" / "rollout_worker.log").read_text()
    if sync == "collective":
        arrived = [line for line in log.splitlines() if "arrived whole" in line]
        assert len(arrived) == len(loaded) and all(" 1 buckets" not in line for line in arrived), arrived
    else:
        assert "arrived whole" not in log
    if standin:  # every bucket went through the device communicator, on both ends
        buckets = sum(int(line.split(" buckets")[0].rsplit("(", 1)[1]) for line in arrived)
        for rank in (0, 1):
            calls = _jsonl(tmp_path / f"comm-rank{rank}.jsonl")
            assert len(calls) == buckets and all(c["dtype"] == "torch.uint8" for c in calls), (rank, len(calls), buckets)
    assert not children(os.getpid()), "the worker outlived the run"


def test_a_sender_stopped_mid_version_leaves_the_worker_on_its_previous_one_and_resume_goes_on(tmp_path):
    """The trainer stops sending version 2 after 1 of its buckets (fault injection): the
    worker refuses the torn version and never loads it, the run stops with the checkpoint
    of step 2 and the exit code of the other worker failures (3), and ``--resume`` trains
    the remaining steps over a fresh group."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    out = tmp_path / "run"
    sets = ("train.steps=4", "checkpoint.every=1", "rollout.weight_sync=collective", SMALL_BUCKETS)
    proc = _start(out, *sets, **{SYNC_FAULT_ENV: "stop@2:1", DUMP_ENV: str(dumps)})
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 3, err[-3000:]
    assert "weights version 2 could not be sent whole" in err and "the worker refuses a torn version" in err, err[-3000:]
    loaded = sorted(int(p.stem[1:]) for p in dumps.glob("v*.safetensors"))
    assert loaded and 2 not in loaded and max(loaded) <= 1, loaded
    log = (out / "rollout_worker.log").read_text()
    assert "version 2 arrived torn and was refused" in log, log[-3000:]
    assert CheckpointManager.load_state(CheckpointManager(out).latest())["step"] == 2

    proc = _start(out, *sets, resume=True, **{DUMP_ENV: str(dumps)})
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert [r["step"] for r in _jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (dumps / "v2.safetensors").exists() and (dumps / "v3.safetensors").exists()


def test_config_checks_weight_sync():
    assert TrainConfig.load(None, []).rollout.weight_sync == "collective"
    with pytest.raises(ConfigError, match="rollout.weight_sync"):
        TrainConfig.load(None, ["rollout.weight_sync=nccl"])
    with pytest.raises(ConfigError, match="rollout.sync_bucket_mb"):
        TrainConfig.load(None, ["rollout.sync_bucket_mb=0"])



@pytest.mark.compares_runs
@pytest.mark.parametrize("sync", ["collective", "file"])
def test_two_workers_share_the_steps_and_each_holds_the_trainers_weights_bitwise(tmp_path, monkeypatch, sync):
    """rollout.num_workers=2: worker (s - 1) mod 2 generates the batch of step s, every
    worker gets every version (through one group of three, or the slot files, which are
    rewritten only once both workers loaded the version they held), the staleness rule is
    unchanged, and both workers are stopped with the run."""
    from async_capture import capture_async

    dumps = tmp_path / "dumps"
    dumps.mkdir()
    monkeypatch.setenv(DUMP_ENV, str(dumps))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    snapshots, batches = capture_async(monkeypatch)
    trainer = _run(tmp_path, "train.steps=4", "rollout.mode=async", "rollout.num_workers=2",
                   f"rollout.weight_sync={sync}", SMALL_BUCKETS, "rewards=[{name: 'trainer_fast:varied_reward'}]")
    assert trainer.step == 4
    log = _jsonl(tmp_path / "run" / "rollout_batches.jsonl")
    assert [(b["step"], b["worker"], b["version"]) for b in log] == [(1, 0, 0), (2, 1, 0), (3, 0, 1), (4, 1, 2)]
    rows = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 1]
    compared = set()
    for prefix in ("", "w1-"):
        loaded = sorted(int(p.stem.split("v")[-1]) for p in dumps.glob(f"{prefix}v*.safetensors"))
        assert loaded, f"worker {prefix or 'w0'} loaded nothing"
        compared.update(loaded)
        for version in loaded:
            worker = load_file(dumps / f"{prefix}v{version}.safetensors")
            assert [k for k in snapshots[version] if not torch.equal(worker[k], snapshots[version][k])] == []
    # the versions compared moved by training (equal versions would make the check vacuous)
    run_guard.assert_trained(run_guard.grad_norms(tmp_path / "run"), snapshots[0], snapshots[max(compared)],
                             what=f"the versions sent to two workers over {sync}")
    assert (tmp_path / "run" / "rollout_worker-1.log").exists()
    assert not children(os.getpid()), "a worker outlived the run"
