"""rollout.sync_comm: what carries the async weight sync, device to device (NCCL / HCCL
through vLLM's communicator) or Gloo through host memory. The choice is logic over the
config, the trainer's device and the installed packages, checked here without a device;
the transfers themselves: tests/weight_sync (Gloo, and the stand-in of vLLM's
communicators) and tests/trainer/test_async_weight_sync.py (a whole run over the stand-in)."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

from portarl.trainer.asynchronous.sync import CollectiveSync, choose_comm
from portarl.trainer.config import ConfigError
from trainer_fast import fast_config

CUDA0 = torch.device("cuda", 0)
#: torch.device("npu", 0) as it is once torch_npu registers the type (not importable here)
NPU0 = types.SimpleNamespace(type="npu", index=0)


@pytest.fixture
def installed(monkeypatch):
    """Which of vllm / vllm_ascend find_spec reports (the rest of the world unchanged)."""
    present: set[str] = set()
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in ("vllm", "vllm_ascend"):
            return object() if name in present else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return present


@pytest.mark.parametrize("device, workers, packages, expected", [
    (CUDA0, ["cuda:1", "cuda:2"], {"vllm"}, "nccl"),
    (NPU0, ["npu:7"], {"vllm", "vllm_ascend"}, "hccl"),
    (torch.device("cuda", 3), ["cuda:0"], {"vllm"}, "nccl"),  # rank 0 on cuda:3, the worker on cuda:0
    (CUDA0, ["cuda"], {"vllm"}, "gloo"),  # "cuda" is cuda:0, rank 0's own device
    (CUDA0, ["cuda:0"], {"vllm"}, "gloo"),
    (CUDA0, ["cuda:1", "cuda:1"], {"vllm"}, "gloo"),  # two workers on one device
    (CUDA0, None, {"vllm"}, "gloo"),  # the workers on the trainer's device
    (CUDA0, ["npu:1"], {"vllm"}, "gloo"),
    (CUDA0, ["cuda:1"], set(), "gloo"),  # no vLLM: no communicator
    (NPU0, ["npu:1"], {"vllm"}, "gloo"),  # vllm without vllm-ascend
    (torch.device("cpu"), ["cpu"], {"vllm"}, "gloo"),
])
def test_auto_takes_the_device_path_only_where_it_can_run(installed, device, workers, packages, expected):
    installed.update(packages)
    comm, why = choose_comm("auto", device, workers)
    assert comm == expected, why
    if expected != "gloo":
        assert "device to device" in why


@pytest.mark.parametrize("setting, device, workers, packages, reason", [
    ("nccl", CUDA0, ["cuda:0"], {"vllm"}, "a worker is on rank 0's own device cuda:0"),
    ("nccl", CUDA0, None, {"vllm"}, "the workers run on the trainer's device"),
    ("nccl", CUDA0, ["cuda:1"], set(), "vllm is not installed"),
    ("hccl", NPU0, ["npu:1"], {"vllm"}, "vllm_ascend is not installed"),
    ("hccl", CUDA0, ["cuda:1"], {"vllm"}, "the trainer runs on cuda, whose communicator is nccl"),
    ("nccl", torch.device("cpu"), ["cpu"], {"vllm"}, "the trainer runs on cpu"),
    ("nccl", CUDA0, ["cuda:2", "cuda:2"], {"vllm"}, "two workers share a device"),
])
def test_an_explicit_device_comm_that_cannot_run_is_refused_with_the_reason(installed, setting, device, workers,
                                                                             packages, reason):
    installed.update(packages)
    with pytest.raises(ConfigError, match=f"rollout.sync_comm={setting} cannot run here: {reason}.*sync_comm=auto"):
        choose_comm(setting, device, workers)


def test_gloo_is_taken_when_asked_even_where_the_device_path_could_run(installed):
    installed.add("vllm")
    assert choose_comm("gloo", CUDA0, ["cuda:1"])[0] == "gloo"


@pytest.mark.parametrize("sets, message", [
    (["rollout.sync_comm=tcp"], "rollout.sync_comm must be auto, gloo, nccl or hccl"),
    (["rollout.sync_comm=nccl"], "needs rollout.mode=async and rollout.weight_sync=collective"),
    (["rollout.mode=async", "rollout.weight_sync=file", "rollout.sync_comm=nccl", "rollout.worker_devices=[cuda:1]"],
     "needs rollout.mode=async and rollout.weight_sync=collective"),
    (["rollout.mode=async", "rollout.sync_comm=nccl"], "give every worker a cuda device of its own"),
    (["rollout.mode=async", "rollout.sync_comm=hccl", "rollout.worker_devices=[cuda:1]"],
     "give every worker a npu device of its own"),
])
def test_bad_sync_comm_names_the_field(tmp_path, sets, message):
    with pytest.raises(ConfigError, match=message):
        fast_config(tmp_path, *sets)


def test_the_run_hands_its_workers_the_chosen_comm_and_packs_on_rank_0s_device(tmp_path, installed, caplog):
    """A CUDA trainer with its workers on devices of their own: the group is built for NCCL
    on rank 0's device (joined at the first send, so nothing runs here), and each worker's
    spec tells it to join with NCCL and stage on its own device."""
    installed.add("vllm")
    cfg = fast_config(tmp_path, "rollout.mode=async", "rollout.num_workers=2", "rollout.worker_devices=[cuda:1, cuda:2]")
    with caplog.at_level("INFO", logger="portarl.trainer"):
        group = CollectiveSync.for_run(cfg, CUDA0)
    try:
        assert group.group.comm_kind == "nccl" and group.group.device == CUDA0
        assert [group.spec(i)["comm"] for i in (0, 1)] == ["nccl", "nccl"]
        assert [group.spec(i)["rank"] for i in (0, 1)] == [1, 2]
        assert "async weight sync over nccl (cuda:0 to cuda:1, cuda:2, device to device)" in caplog.text
    finally:
        group.close()
    cfg.rollout.sync_comm = "gloo"
    group = CollectiveSync.for_run(cfg, CUDA0)
    try:
        assert group.group.comm_kind == "gloo" and group.group.device == torch.device("cpu")
        assert group.spec(0)["comm"] == "gloo"
    finally:
        group.close()

