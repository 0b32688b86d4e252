"""The lean decode step (:mod:`portarl.rollout.lean_decode`) held to the model itself.

Per supported architecture (Llama, Mistral, Qwen2, Qwen3; grouped-query and multi-head
attention; left-padded prompts of different lengths; a prompt repeated, so the prefill is
deduplicated): the logits of every decode step equal the last-position logits of a plain
forward over the whole sequence (no cache), within the fp32 tolerance. The engine's samples
and log-probs are those of the Hugging Face decode path, also with a LoRA adapter injected by
peft. Where the step cannot reproduce the model, the engine says why and uses the forward.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from portarl.parity.tolerances import fp32_result  # noqa: E402
from portarl.rollout import HFRollout, SamplingParams, request_seeds  # noqa: E402
from portarl.rollout.hf import left_pad  # noqa: E402
from portarl.rollout.lean_decode import LeanDecoder, unsupported_reason  # noqa: E402
from portarl.assets.tokenizer import CharTokenizer  # noqa: E402

TOK = CharTokenizer()
CONFIGS = {
    "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
}


def _model(arch: str, kv_heads: int = 2, attn: str = "sdpa", seed: int = 0, **overrides):
    config = getattr(transformers, CONFIGS[arch])(
        vocab_size=len(TOK), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
        initializer_range=0.2,  # large enough that a wrong position, mask or head shows in the logits
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.eval()


PROMPTS = [TOK.encode("3+4="), TOK.encode("12+30="), TOK.encode("3+4="), TOK.encode("7=")]


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = fp32_result(float(want.abs().max()))
    err = (got - want).abs()
    assert bool((err <= tol.allowed(want)).all()), f"{what}: max error {float(err.max()):.3g} > {tol.atol:.3g}"


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@torch.inference_mode()
def test_each_step_equals_a_plain_forward_over_the_whole_sequence(arch, kv_heads):
    model = _model(arch, kv_heads)
    engine = HFRollout(model, TOK.eos_token_id, TOK.pad_token_id, share_prefill=True)  # its cache rows too
    steps = 6
    past, logits, mask, positions = engine._prefill(PROMPTS, "cpu")
    assert unsupported_reason(model, mask.shape[1] + steps) is None
    decoder = LeanDecoder(model, past, mask, steps)
    fed = torch.randint(3, len(TOK), (len(PROMPTS), steps), generator=torch.Generator().manual_seed(1))
    for t in range(steps):
        got = decoder.step(fed[:, t : t + 1], positions + t)
        seqs = [list(p) + fed[i, : t + 1].tolist() for i, p in enumerate(PROMPTS)]
        ids, full_mask = left_pad(seqs, TOK.pad_token_id, "cpu")
        want = model(input_ids=ids, attention_mask=full_mask,
                     position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
        _assert_close(got, want, f"{arch} step {t}")


def _both_paths(model, **params):
    prompts, seeds = PROMPTS * 2, request_seeds(3, 1, 8, 1)
    out = {}
    for lean in (True, False):
        engine = HFRollout(model, TOK.eos_token_id, TOK.pad_token_id, lean_decode=lean)
        out[lean] = engine.generate(prompts, seeds, SamplingParams(max_new_tokens=7, **params))
        out[f"path_{lean}"] = engine.decode_path
    return out


def _assert_same_samples(out) -> None:
    assert out["path_True"] == "lean"
    assert out[True].completion_ids == out[False].completion_ids
    for a, b in zip(out[True].logprobs, out[False].logprobs):
        _assert_close(torch.tensor(a), torch.tensor(b), "rollout log-probs")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_samples_equal_the_hugging_face_decode_path(arch):
    _assert_same_samples(_both_paths(_model(arch), temperature=0.9, top_k=40))


def test_a_lora_adapter_is_decoded_through_its_injected_modules():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_model("qwen2"), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero (adapter = identity): make it matter
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    out = _both_paths(model)
    _assert_same_samples(out)
    with model.disable_adapter():  # and the adapter changed what was sampled
        plain = _both_paths(model)
    assert plain[True].completion_ids != out[True].completion_ids


@pytest.mark.parametrize("build, why", [
    (lambda: _model("qwen2", attn="eager"), "attention implementation 'eager'"),
    (lambda: _model("mistral", sliding_window=8), "sliding window of 8"),
    (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(TOK), n_embd=32, n_layer=1, n_head=2, bos_token_id=1, eos_token_id=2)).eval(),
     "GPT2LMHeadModel is not one of"),
])
def test_models_it_cannot_reproduce_keep_the_forward_and_say_why(build, why):
    model = build()
    engine = HFRollout(model, TOK.eos_token_id, TOK.pad_token_id)
    out = engine.generate(PROMPTS, request_seeds(3, 1, 4, 1), SamplingParams(max_new_tokens=6))
    assert engine.decode_path.startswith("hf (") and why in engine.decode_path
    assert all(len(c) >= 1 for c in out.completion_ids)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf"])
def test_a_partial_call_drops_done_rows_and_samples_what_the_whole_batch_samples(lean, monkeypatch):
    """Partial rollouts (``stop_when``): rows that are done leave the decode batch (their
    KV-cache rows dropped) once a quarter of the rows are done; every row still gets the
    tokens and log-probs a call decoding every row to the end gives it."""
    model = _model("qwen2")
    prompts, seeds = PROMPTS * 2, request_seeds(3, 1, 8, 1)
    ends = [2, 9, 1, 5, 12, 3, 12, 7]  # benchmark lengths (PORTARL_BENCH_LENGTHS' end_at): rows end apart
    params = SamplingParams(max_new_tokens=12, temperature=0.9)
    widths = []
    real_step = LeanDecoder.step
    monkeypatch.setattr(LeanDecoder, "step", lambda self, tok, pos: widths.append(tok.shape[0]) or real_step(self, tok, pos))
    whole = HFRollout(model, TOK.eos_token_id, TOK.pad_token_id, lean_decode=lean)
    want = whole.generate(prompts, seeds, params, end_at=ends)
    dropped = HFRollout(model, TOK.eos_token_id, TOK.pad_token_id, lean_decode=lean)
    rows = []
    got = dropped.generate(prompts, seeds, params, end_at=ends, row_limits=[12] * 8,
                           stop_when=lambda done: rows.append(int((~done).sum())) and False)
    assert dropped.decode_path == ("lean" if lean else whole.decode_path)
    assert [len(c) for c in got.completion_ids] == ends
    assert got.completion_ids == want.completion_ids and got.finished == want.finished
    for a, b in zip(got.logprobs, want.logprobs):
        _assert_close(torch.tensor(a), torch.tensor(b), "log-probs of a row decoded in a smaller batch")
    if lean:  # the decode batch shrank as rows ended (the whole call kept all 8 to the end)
        assert widths[:11] == [8] * 11 and min(widths[11:]) < 8 and widths[-1] == 2, widths


def test_benchmark_lengths_hold_even_where_the_model_would_stop_at_once():
    """``end_at`` (``PORTARL_BENCH_LENGTHS``): a row ends at its length exactly; the model's
    own stop token is not drawn before it (a model that ends at once shows it)."""
    model = _model("qwen2")
    head = torch.nn.Linear(model.config.hidden_size, len(TOK), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[TOK.eos_token_id] = 50.0  # the end-of-sequence token, always, unless it is masked
    model.lm_head = head
    prompts, seeds = PROMPTS * 2, request_seeds(3, 1, 8, 1)
    engine = HFRollout(model, TOK.eos_token_id, TOK.pad_token_id)
    params = SamplingParams(max_new_tokens=12, temperature=0.9)
    assert [len(c) for c in engine.generate(prompts, seeds, params).completion_ids] == [1] * 8
    ends = [2, 9, 1, 5, 12, 3, 12, 7]
    out = engine.generate(prompts, seeds, params, end_at=ends)
    assert [len(c) for c in out.completion_ids] == ends
    assert all(c[-1] == TOK.eos_token_id and TOK.eos_token_id not in c[:-1] for c in out.completion_ids)
    assert out.finished == [True] * 8
