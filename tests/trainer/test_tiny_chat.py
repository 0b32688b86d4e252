"""Issue 44: agents on the built-in tiny model. ``model.path: tiny`` has a character tokenizer
without a chat template, so tools and environments were refused with a hint
(``data.chat_template``) that was refused next; ``model.path: tiny-chat`` is the same tiny
Qwen2 with a byte-level ChatML tokenizer whose template declares tools, and every refusal
points at it. ``data.sft_path``: the warm-up's demonstrations in a file of their own."""

from __future__ import annotations

import json

import pytest

from portarl.assets.data import Example
from portarl.assets.models import build_model, build_tiny, load_local, save_local
from portarl.multiturn.parsing import detect_format
from portarl.multiturn.render import Renderer, declares_tools
from portarl.assets.tokenizer import CharTokenizer, as_codec, byte_chat_tokenizer
from portarl.trainer import GRPOTrainer, build_from_config
from trainer_fast import fast_config

TOOLS = "tools=[agent_tools:multiply]"


def test_the_byte_tokenizer_encodes_any_text_and_declares_tools_in_the_hermes_format():
    tok = byte_chat_tokenizer()
    assert len(tok) == 259 and (tok.pad_token_id, tok.eos_token_id) == (0, 2)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    text = 'café <tool_call>{"a": 7}</tool_call>\n×'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text  # one token per byte, nothing dropped
    assert declares_tools(tok.chat_template) and detect_format(tok.chat_template, True) == "hermes"
    tools = [{"type": "function", "function": {"name": "multiply", "parameters": {"properties": {"a": {}, "b": {}}}}},
             {"type": "function", "function": {"name": "now"}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 times 8?"},
                {"role": "assistant", "content": "<tool_call>...</tool_call>"},
                {"role": "tool", "name": "multiply", "content": "56"}]
    assert tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.\nTools: multiply(a, b), now()<|im_end|>\n<|im_start|>user\nWhat is 7 times 8?"
        "<|im_end|>\n<|im_start|>assistant\n<tool_call>...</tool_call><|im_end|>\n<|im_start|>tool\n56<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages[1:2], tokenize=False) == "<|im_start|>user\nWhat is 7 times 8?<|im_end|>\n"


def test_tiny_chat_is_the_tiny_model_with_room_for_a_conversation_and_saves_as_a_plain_model(tmp_path):
    cfg = fast_config(tmp_path, "model.path=tiny-chat")
    model, tok = build_model(cfg.model)
    assert model.config.vocab_size == len(tok) == 259 and model.config.max_position_embeddings == 4096
    assert model.config.hidden_size == cfg.model.hidden_size
    plain, char = build_tiny()  # model.path: tiny, as the demo's figures were measured
    assert isinstance(char, CharTokenizer) and plain.config.max_position_embeddings == 128
    save_local(model, tok, tmp_path / "saved")  # what a checkpoint and `portarl export` write
    _, loaded = load_local(tmp_path / "saved")
    messages = [{"role": "user", "content": "What is 7 times 8?"}]
    assert loaded.chat_template == tok.chat_template
    assert as_codec(loaded).encode_prompt(messages) == as_codec(tok).encode_prompt(messages)


def test_the_refusals_on_the_tiny_model_point_at_tiny_chat_and_following_them_works(tmp_path):
    """Before: "tools and environments need a chat template ... (the built-in character
    tokenizer, or data.chat_template=none)", and setting data.chat_template was refused with
    "use a Hugging Face tokenizer"."""
    for overrides, refusal in [((TOOLS,), "tools and environments need a chat template"),
                               (("environment=agent_tools:CountEnv",), "tools and environments need a chat template"),
                               (("data.system_prompt=Be brief.",), "data.system_prompt is set")]:
        cfg = fast_config(tmp_path, *overrides)
        model, tokenizer, examples = build_from_config(cfg)
        with pytest.raises(ValueError, match=refusal) as err:
            GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
        assert "use model.path: tiny-chat" in str(err.value)
    with pytest.raises(ValueError, match="data.chat_template: .*use model.path: tiny-chat"):
        as_codec(CharTokenizer(), chat_template="{{ messages }}")
    cfg = fast_config(tmp_path, "model.path=tiny-chat", TOOLS, "rewards=[{name: environment}]",
                      "environment=agent_tools:CountEnv", "rollout.max_turns=2", "loss.kl_coef=0")
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    try:
        metrics = trainer.train_step()  # the arithmetic prompts, as episodes of up to 2 turns
    finally:
        trainer.close()
    assert metrics["agent/turns_mean"] >= 1 and metrics["agent/finish_length_frac"] == 1  # 3 new tokens a turn
    assert trainer.codec.tokenizer.decode(trainer.encoded_prompt(examples[0])).startswith(
        "<|im_start|>system\nTools: multiply(a, b)<|im_end|>\n<|im_start|>user\n")
    Renderer(trainer.codec)  # the template renders tool results and observations


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_warm_up_reads_data_sft_path_relative_to_its_config_and_checks_it_first(tmp_path):
    from portarl.trainer import TrainConfig

    _rows(tmp_path / "questions.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="}])  # no answers: GRPO needs none
    _rows(tmp_path / "demos.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    (tmp_path / "c.yaml").write_text("data: {path: questions.jsonl, sft_path: demos.jsonl}\n"
                                     "rewards: [{name: \"agent_tools:reward_final_length\"}]\n")
    cfg = TrainConfig.load(tmp_path / "c.yaml", [f"output_dir={tmp_path / 'run'}", "train.steps=1",
                                                 "train.sft_warmup_steps=2", "train.sft_batch_size=2",
                                                 "model.hidden_size=32", "model.intermediate_size=64",
                                                 "logging.progress=false", "logging.plot=false",
                                                 "logging.tensorboard=false"])
    assert cfg.data.sft_path == str(tmp_path / "demos.jsonl")
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    try:
        assert [ex.answer for ex in trainer.sft_examples] == ["2", "4"]
        assert [ex.answer for ex in trainer.examples] == [None, None]
        trainer.warmup_sft()
        assert trainer.sft_done
    finally:
        trainer.close()
    _rows(tmp_path / "demos.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}])
    with pytest.raises(ValueError, match=r"demos.jsonl:2: no answer field .*data.sft_path"):
        GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    cfg.data.sft_path = str(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match=r"data.sft_path: data file .*missing.jsonl does not exist"):
        GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")
    cfg.data.sft_path = None  # the warm-up on data.path's rows needs their answers, as before
    with pytest.raises(ValueError, match=r"questions.jsonl:1: no answer field .*train.sft_warmup_steps"):
        GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")


def test_sft_data_of_a_conversation_renders_as_the_episode_appends_it():
    """A demonstration of the second model turn (question, call, tool result) encodes to the
    ids an episode holds at that point: the warm-up teaches what GRPO then samples from."""
    tok = byte_chat_tokenizer()
    codec = as_codec(tok)
    codec.tools = [{"type": "function", "function": {"name": "multiply", "parameters": {"properties": {"a": {}}}}}]
    question = [{"role": "user", "content": "What is 7 times 8?"}]
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 7, "b": 8}}</tool_call>'
    demo = Example(question + [{"role": "assistant", "content": call},
                               {"role": "tool", "name": "multiply", "content": "56"}], "56")
    episode = (codec.encode_prompt(question) + tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
               + Renderer(codec).continuation_ids([{"role": "tool", "name": "multiply", "content": "56"}],
                                                  last_model_token=tok.eos_token_id))
    assert codec.encode_prompt(demo.prompt) == episode
