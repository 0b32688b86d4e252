"""Data files (JSONL, Parquet), reward functions, tokenizer, local model directories."""

from __future__ import annotations

import json

import pytest
import torch

from portarl.assets.data import Example, arithmetic_examples, load_examples, write_jsonl
from portarl.assets.models import build_tiny, load_local, save_local
from portarl.assets.rewards import extract_answer, format_reward, math_exact, resolve_reward
from portarl.assets.tokenizer import CharTokenizer, as_codec


def test_jsonl_and_parquet(tmp_path):
    examples = arithmetic_examples(5, seed=1)
    write_jsonl(examples, tmp_path / "d.jsonl")
    assert load_examples(tmp_path / "d.jsonl") == examples
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": [e.prompt for e in examples], "solution": [e.answer for e in examples]}),
                   tmp_path / "d.parquet")
    assert load_examples(tmp_path / "d.parquet", prompt_field="question", answer_field="solution") == examples


def test_data_errors_name_the_place(tmp_path, make_trainer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "1+2="}) + "\n")
    assert load_examples(bad)[1].answer is None  # the answer is optional: batched rewards may not need one
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no answer field .*math_exact"):
        make_trainer(f"data.path={bad}")  # ... but math_exact does
    bad.write_text(json.dumps({"answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing field 'prompt'"):
        load_examples(bad)
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_examples(bad)
    with pytest.raises(ValueError, match="use .jsonl or .parquet"):
        (tmp_path / "d.csv").write_text("x")
        load_examples(tmp_path / "d.csv")


def test_empty_prompts_are_refused_or_skipped_with_a_count(tmp_path, caplog):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "  ", "answer": "0"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "\n"}], "answer": "0"},
            {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"d.jsonl:2: field 'prompt' is empty or only whitespace: .*"
                                         r"data.empty_prompts=skip"):
        load_examples(data)
    with caplog.at_level("WARNING", logger="portarl.assets.data"):
        kept = load_examples(data, empty_prompts="skip")
    assert [e.where for e in kept] == [f"{data}:1", f"{data}:4"]
    assert f"left out 2 row(s) of {data} whose prompt is empty or only whitespace ({data}:2, {data}:3)" in caplog.text


def test_non_utf8_data_names_file_and_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes('\ufeff{"prompt": "1+1=", "answer": "2"}\n'.encode() + b'{"prompt": "\xff", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid UTF-8 \(byte 0xff at byte 13 of the line\)"):
        load_examples(data)
    data.write_bytes('\ufeff{"prompt": "1+1=", "answer": "2"}\n'.encode())  # a byte-order mark is fine
    assert load_examples(data)[0].prompt == "1+1="


def test_training_on_a_jsonl_file(make_trainer, tmp_path):
    write_jsonl([Example("2+2=", "4"), Example("3+3=", "6")] * 4, tmp_path / "train.jsonl")
    trainer = make_trainer(f"data.path={tmp_path / 'train.jsonl'}", "train.steps=1")
    assert {e.answer for e in trainer.examples} == {"4", "6"}
    trainer.train()


def test_math_exact_and_format():
    assert extract_answer("so the answer is \\boxed{42}.") == "42"
    assert extract_answer("12 then 19") == "19"
    assert math_exact("", "19", "19") == 1.0
    assert math_exact("", "the sum is 19.0", "19") == 1.0
    assert math_exact("", "\\boxed{18} or 19", "19") == 0.0  # boxed wins
    assert math_exact("", "", "19") == 0.0
    assert format_reward("", "19", "") == 1.0 and format_reward("", "x19", "") == 0.0
    assert format_reward("", "so \\boxed{7}", "") == 1.0


def test_user_rewards_by_module_path():
    assert resolve_reward("portarl.assets.rewards:math_exact") is math_exact
    with pytest.raises(ValueError, match="cannot be loaded"):
        resolve_reward("portarl.assets.rewards:nope")
    with pytest.raises(ValueError, match="module:function"):
        resolve_reward("nope")


def test_char_tokenizer():
    tok = CharTokenizer()
    ids = tok.encode("12+7=")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "12+7="
    assert tok.decode([5, tok.eos_token_id, 6]) == tok.decode([5, 6])
    with pytest.raises(ValueError, match="not in the tokenizer's alphabet"):
        tok.encode("1 + é")
    codec = as_codec(tok)
    assert codec.pad_token_id == 0 and codec.eos_token_id == 2


def test_local_model_directory_round_trip(tmp_path, make_trainer):
    model, tok = build_tiny(seed=4, hidden_size=32, intermediate_size=64)
    save_local(model, tok, tmp_path / "m")
    loaded, tok2 = load_local(tmp_path / "m")
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    assert isinstance(tok2, CharTokenizer)
    trainer = make_trainer(f"model.path={tmp_path / 'm'}", "train.steps=1")
    trainer.train()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_local(tmp_path)
