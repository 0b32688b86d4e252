"""Conversational prompts through the tokenizer's own chat template, the end-of-turn stop,
and data checked when it loads (issue 16 item 1, issue 13 item 5)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from chat_tiny import CHATML, chat_tokenizer, tiny_llama
from portarl.assets.data import load_examples
from portarl.rollout import SamplingParams
from portarl.rollout.hf import HFRollout
from portarl.assets.tokenizer import CharTokenizer, as_codec, chat_template_option
from portarl.trainer import GRPOTrainer
from trainer_fast import fast_config

CONVERSATION = ({"role": "user", "content": "What is 1 + 2 ?"},)


def _reference_ids(tok, messages, **kwargs):
    out = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def test_prompt_ids_are_exactly_apply_chat_template():
    tok = chat_tokenizer()
    codec = as_codec(tok)
    assert codec.encode_prompt(CONVERSATION) == _reference_ids(tok, CONVERSATION)
    # a plain string under "auto" stays raw text (no system prompt set) ...
    assert codec.encode_prompt("What is 1 + 2 ?") == tok("What is 1 + 2 ?")["input_ids"]
    # ... and becomes a user turn after the system prompt when one is set
    with_system = as_codec(tok, system_prompt="Answer with a number only")
    expected = _reference_ids(tok, [{"role": "system", "content": "Answer with a number only"}, CONVERSATION[0]])
    assert with_system.encode_prompt("What is 1 + 2 ?") == expected
    assert tok.convert_ids_to_tokens(expected)[:2] == ["<|im_start|>", "system"]


def test_template_file_and_none(tmp_path):
    tok = chat_tokenizer()
    other = CHATML.replace("You are helpful", "the answer")
    (tmp_path / "t.jinja").write_text(other)
    codec = as_codec(tok, chat_template=chat_template_option(str(tmp_path / "t.jinja")))
    ids = codec.encode_prompt("What is 1 + 2 ?")  # a template file applies to every prompt
    assert ids == _reference_ids(tok, CONVERSATION, chat_template=other)
    assert ids != _reference_ids(tok, CONVERSATION)
    none = as_codec(tok, chat_template="none")
    with pytest.raises(ValueError, match="conversation but there is no chat template"):
        none.encode_prompt(CONVERSATION)
    with pytest.raises(ValueError, match="neither 'auto', 'none' nor a Jinja template file"):
        chat_template_option(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="no chat support"):
        as_codec(CharTokenizer(), chat_template=other)


def test_end_of_turn_token_stops_generation():
    tok = chat_tokenizer()
    codec = as_codec(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tok.eos_token_id and codec.stop_token_ids == [tok.eos_token_id, im_end]
    model = tiny_llama(len(tok))
    # The model wants <|im_end|> at every position: it must end the completion there.
    def prefer_im_end(module, args, out):
        out.logits[..., im_end] += 50.0

    model.register_forward_hook(prefer_im_end)
    prompt = codec.encode_prompt(CONVERSATION)
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    stopped = HFRollout(model, codec.eos_token_id, codec.pad_token_id, stop_token_ids=codec.stop_token_ids).generate(
        [prompt], [0], params)
    assert stopped.completion_ids == [[im_end]] and stopped.finished == [True]
    eos_only = HFRollout(model, tok.eos_token_id, codec.pad_token_id).generate([prompt], [0], params)
    assert len(eos_only.completion_ids[0]) == 5 and eos_only.finished == [False]


def test_values_are_not_coerced(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": [{"role": "user", "content": "hi"}], "answer": "x", "level": 3}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = load_examples(f)
    assert a.answer == "2" and b.prompt == ({"role": "user", "content": "hi"},) and b.columns == {"answer": "x", "level": 3}
    for bad, field, shown in [({"prompt": None, "answer": "1"}, "prompt", "null"),
                              ({"prompt": [4], "answer": "1"}, "prompt", "message 0"),
                              ({"prompt": "1+1=", "answer": [4]}, "answer", r"list \[4\]"),
                              ({"prompt": "1+1=", "answer": None}, "answer", "null")]:
        f.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=rf"d.jsonl:2: field '{field}' .*{shown}"):
            load_examples(f)


def _trainer(tmp_path, *overrides):
    cfg = fast_config(tmp_path, *overrides)
    from portarl.trainer import build_from_config

    model, tok, examples = build_from_config(cfg)
    return GRPOTrainer(model, tok, None, examples, cfg, device="cpu")


def test_every_prompt_is_checked_when_the_data_loads(tmp_path, caplog):
    f = tmp_path / "d.jsonl"
    lines = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(9)]
    lines.insert(6, json.dumps({"prompt": "1+1=!", "answer": "2"}))  # '!' is not in the char tokenizer
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:7: the prompt cannot be encoded: character '!'"):
        _trainer(tmp_path, f"data.path={f}")
    f.write_text(json.dumps({"prompt": "1+1=" * 40, "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: the prompt is 161 tokens; .*context length 128"):
        _trainer(tmp_path, f"data.path={f}")
    f.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with caplog.at_level(logging.WARNING, logger="portarl.train"):
        _trainer(tmp_path, f"data.path={f}")
    assert "larger than the 1 examples: prompts are drawn with replacement" in caplog.text
