"""rollout.worker_devices: each async rollout worker on a device of its own, its process
seeing only that device (the placement is computed here; no accelerator runs here, so the
trainer side is checked up to the worker's start, and the CPU case end to end)."""

from __future__ import annotations

import pytest
import torch

from portarl.backends.device import child_placement
from portarl.trainer import GRPOTrainer, build_from_config
from portarl.trainer.config import ConfigError
from trainer_fast import fast_config


@pytest.mark.parametrize("device, environ, expected", [
    ("cpu", {}, ("cpu", {})),
    ("cuda:1", {}, ("cuda:0", {"CUDA_VISIBLE_DEVICES": "1"})),
    ("cuda", {}, ("cuda:0", {"CUDA_VISIBLE_DEVICES": "0"})),
    ("cuda:1", {"CUDA_VISIBLE_DEVICES": "2,3"}, ("cuda:0", {"CUDA_VISIBLE_DEVICES": "3"})),  # the trainer's numbering
    ("npu:6", {"CUDA_VISIBLE_DEVICES": "0"}, ("npu:0", {"ASCEND_RT_VISIBLE_DEVICES": "6"})),
    ("npu:0", {"ASCEND_RT_VISIBLE_DEVICES": " 4, 5"}, ("npu:0", {"ASCEND_RT_VISIBLE_DEVICES": "4"})),
])
def test_a_worker_sees_only_its_device(device, environ, expected):
    assert child_placement(device, environ) == expected


def test_a_device_the_trainer_cannot_see_is_refused():
    with pytest.raises(ValueError, match="cuda:2 is not visible.*CUDA_VISIBLE_DEVICES=2,3 shows 2"):
        child_placement("cuda:2", {"CUDA_VISIBLE_DEVICES": "2,3"})
    with pytest.raises(ValueError, match="'gpu:1' is not a device"):
        child_placement("gpu:1", {})


@pytest.mark.parametrize("sets, message", [
    (["rollout.worker_devices=[cuda:1]"], "rollout.worker_devices places async rollout workers"),
    (["rollout.mode=async", "rollout.num_workers=2", "rollout.worker_devices=[cuda:1]"],
     r"must list one device per worker \(rollout.num_workers=2\)"),
    (["rollout.mode=async", "rollout.worker_devices=[gpu:1]"], "'gpu:1' is not a device"),
    (["rollout.mode=async", "rollout.worker_devices=cuda:1"], "must list one device per worker"),
])
def test_bad_worker_devices_name_the_field(tmp_path, sets, message):
    with pytest.raises(ConfigError, match=message):
        fast_config(tmp_path, *sets)


def test_each_worker_is_started_on_its_device_with_only_it_visible(tmp_path, monkeypatch):
    import portarl.trainer.asynchronous.pipeline as pipeline

    started = []

    class Recorder:
        def __init__(self, spec, *args, index=0, env=None, **kwargs):
            started.append((index, spec["device"], env))
            self.loaded, self.name = -1, f"recorded worker {index}"

        def close(self):
            pass

    monkeypatch.setattr(pipeline, "WorkerClient", Recorder)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    cfg = fast_config(tmp_path, "rollout.mode=async", "rollout.num_workers=2", "rollout.weight_sync=file",
                      "rollout.worker_devices=[cuda:2, cuda:3]")
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    rollout = pipeline.AsyncRollout(trainer)
    rollout.close()
    assert started == [(0, "cuda:0", {"CUDA_VISIBLE_DEVICES": "6"}), (1, "cuda:0", {"CUDA_VISIBLE_DEVICES": "7"})]
    started.clear()
    cfg.rollout.worker_devices = None  # the default: the trainer's device, nothing hidden
    rollout = pipeline.AsyncRollout(trainer)
    rollout.close()
    assert started == [(0, "cpu", {}), (1, "cpu", {})]


@pytest.mark.parametrize("workers, trainer, local_ranks, taken", [
    (["cuda:1"], "cuda:0", None, None),
    (["cuda:0"], "cuda:0", None, "cuda:0"),
    (["cuda"], "cuda:0", None, "cuda"),  # "cuda" is device 0
    (["cuda:0"], "cuda:1", None, None),  # one process on cuda:1: cuda:0 is free
    (["cuda:3", "cuda:4"], "cuda:0", 4, "cuda:3"),  # torchrun --nproc-per-node 4: ranks on cuda:0-3
    (["cuda:4", "cuda:5"], "cuda:0", 4, None),
    (["cpu"], "cpu", 2, None),
])
def test_a_worker_on_a_training_ranks_device_is_refused(workers, trainer, local_ranks, taken):
    from portarl.backends.device import check_worker_devices

    if taken is None:
        check_worker_devices(workers, torch.device(trainer), local_ranks)
    else:
        with pytest.raises(ValueError, match=rf"rollout.worker_devices \['{taken}'\] are training devices.*fewer ranks"):
            check_worker_devices(workers, torch.device(trainer), local_ranks)


def test_the_async_trainer_checks_its_workers_against_the_nodes_ranks(tmp_path, monkeypatch):
    """Under torchrun rank r trains on device r of rank 0's numbering: with 8 ranks on the
    node, workers on cuda:6 and cuda:7 would share the devices of ranks 6 and 7."""
    import types

    from portarl.trainer.asynchronous.checks import check_async_trainer

    cfg = fast_config(tmp_path, "rollout.mode=async", "rollout.num_workers=2", "rollout.worker_devices=[cuda:6, cuda:7]")
    trainer = types.SimpleNamespace(rollout_if_built=None, config=cfg, device=torch.device("cuda", 0),
                                    dist=types.SimpleNamespace(enabled=True), rewards_from_config=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match=r"\['cuda:6', 'cuda:7'\] are training devices .*cuda:0, cuda:1"):
        check_async_trainer(trainer)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    check_async_trainer(trainer)
