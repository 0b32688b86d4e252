"""Token truth a person can read (issue 44): samples.jsonl's ``segments`` of a multi-turn
episode are exactly the ids and the loss mask the trainer scored, cut by who wrote them;
the prompt is the one the model saw (tools' description, ``reset()`` text); what came
after the model's last turn is ``unread``, not conversation; ``portarl episodes`` prints it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from agent_tiny import ScriptedRollout, agent_tokenizer, call_text, tiny_model
from portarl.cli import main
from portarl.assets.data import Example
from portarl.trainer import GRPOTrainer
from portarl.trainer.phases.episodes import reward_examples
from scored_rows import capture_scored_batches, segment_mismatch
from trainer_fast import fast_config

QUESTION = [{"role": "user", "content": "What is 12*34?"}]
ANSWER = "The answer is 408."


def _train(tmp_path, script, *overrides):
    """One step, every sample logged; the run's rows and its trainer (closed)."""
    tok = agent_tokenizer()
    model = tiny_model(len(tok))
    cfg = fast_config(tmp_path, "rollout.group_size=2", "train.prompts_per_step=2", "rollout.max_turns=3",
                      "loss.kl_coef=0", "train.steps=1", "logging.samples_every=1", "logging.samples_count=4",
                      *overrides)
    rows = [Example(QUESTION, "408", {"answer": "408"}, "row 1"),
            Example([{"role": "user", "content": "What is 56*34?"}], "1904", {"answer": "1904"}, "row 2")]
    trainer = GRPOTrainer(model, tok, None, rows, cfg, device="cpu", rollout_engine=ScriptedRollout(model, tok, script))
    try:
        trainer.train()
    finally:
        trainer.close()
    logged = [json.loads(line) for line in (trainer.output_dir / "samples.jsonl").read_text().splitlines()]
    return trainer, logged


def _decode(trainer):
    return lambda ids: trainer.tokenizer.decode(list(ids), skip_special_tokens=False)


@pytest.fixture
def tool_run(tmp_path, monkeypatch):
    batches = capture_scored_batches(monkeypatch)
    trainer, rows = _train(tmp_path, [call_text("multiply", a=12, b=34), ANSWER], "tools=['agent_tools:multiply']",
                           "rewards=[{name: math_exact}]")
    return trainer, rows, batches


def test_segments_are_the_scored_ids_and_loss_mask_by_who_wrote_them(tool_run):
    trainer, rows, batches = tool_run
    [batch] = batches
    assert [r["sample"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert segment_mismatch(row, batch, _decode(trainer)) is None
        assert [s["role"] for s in row["segments"]] == ["prompt", "model", "tool", "model"]
        prompt = row["prompt"]  # as the model saw it: the template, the tools' description, the question
        assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "multiply"' in prompt
        assert prompt.endswith("*34?<|im_end|>\n<|im_start|>assistant\n")
        tool = row["segments"][2]
        assert tool["text"] == ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
                                "<|im_start|>assistant\n")
        assert row["segments"][3]["text"] == ANSWER + "<|im_end|>"
        # the conversation's token counts are the segments' (the model's <|im_end|> is the model's)
        assert [m["tokens"] for m in row["conversation"]] == [len(s["ids"]) for s in row["segments"][1:]]
        assert row["unread"] == []


def test_the_check_fails_for_a_dropped_or_mislabelled_segment(tool_run):
    trainer, rows, [batch] = tool_run
    row = rows[0]
    dropped = {**row, "segments": [s for s in row["segments"] if s["role"] != "tool"]}
    assert "ids" in segment_mismatch(dropped, batch, _decode(trainer))
    as_model = {**row, "segments": [{**s, "role": "model"} if s["role"] == "tool" else s for s in row["segments"]]}
    assert "a model run has loss mask 0" in segment_mismatch(as_model, batch, _decode(trainer))
    trained = {**row, "segments": [{**s, "loss_mask": 1} if s["role"] == "tool" else s for s in row["segments"]]}
    assert "a tool run has loss mask 1" in segment_mismatch(trained, batch, _decode(trainer))


def test_an_observation_after_the_last_turn_is_unread_not_conversation(tmp_path, monkeypatch):
    """The environment's verdict after the model's last turn was never appended: the model
    never read it. On main it was listed in the conversation with tokens 0."""
    batches = capture_scored_batches(monkeypatch)
    trainer, rows = _train(tmp_path, ["fine"], "environment=agent_tools:JudgeEnv", "rewards=[{name: environment}]")
    for row in rows:
        assert [(m["role"], m["content"]) for m in row["conversation"]] == [("assistant", "fine")]
        assert row["unread"] == [{"role": "user", "content": "Verdict: fine."}]
        assert row["finish_reason"] == "done"
        assert segment_mismatch(row, batches[0], _decode(trainer)) is None
        assert [s["role"] for s in row["segments"]] == ["prompt", "model"]
        assert row["prompt"].endswith("*34?\n\nAnswer in one word.<|im_end|>\n<|im_start|>assistant\n")  # reset() text
    # what the rewards read is unchanged: the conversation, then what came after it
    episodes = SimpleNamespace(episodes=[{"messages": rows[0]["conversation"], "unread": rows[0]["unread"],
                                          "env_reward": 1.0}])
    [example] = reward_examples([Example(QUESTION, None, {}, "row 1")], 1, episodes, True)
    assert [m["content"] for m in example.columns["conversation"]] == ["fine", "Verdict: fine."]


def test_an_observation_past_max_turns_is_unread(tmp_path, monkeypatch):
    batches = capture_scored_batches(monkeypatch)
    trainer, rows = _train(tmp_path, ["one", "two"], "environment=agent_tools:PidEnv", "rewards=[{name: environment}]",
                           "rollout.max_turns=2")
    for row in rows:
        assert [m["role"] for m in row["conversation"]] == ["assistant", "user", "assistant"]
        assert all(m["tokens"] > 0 for m in row["conversation"])
        assert [m["role"] for m in row["unread"]] == ["user"] and row["unread"][0]["content"].startswith("pid ")
        assert [s["role"] for s in row["segments"]] == ["prompt", "model", "environment", "model"]
        assert segment_mismatch(row, batches[0], _decode(trainer)) is None


def test_portarl_episodes_prints_a_sample_turn_by_turn(tool_run, capsys):
    trainer, rows, _ = tool_run
    run, row = str(trainer.output_dir), rows[1]
    assert main(["episodes", run, "--step", "1", "--sample", "1", "--ids"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"step 1, sample 1: finish stop, 2 turn(s), reward {row['reward']}, advantage {row['advantage']}"
    headers = [line.split() for line in out if line.startswith("  ") and not line.startswith("    ")]
    counts = [len(s["ids"]) for s in row["segments"]]
    assert headers[:4] == [[role, str(n), "tokens", "loss", str(loss)]
                           for role, n, loss in zip(["prompt", "model", "tool", "model"], counts, [0, 1, 0, 1])]
    assert out[-1] == f"  {counts[0]} prompt tokens, {sum(counts[1:])} after it, {counts[1] + counts[3]} in the loss"
    assert [line for line in out if line.startswith("    ids: ")][2] == "    ids: " + " ".join(
        map(str, row["segments"][2]["ids"]))
    assert "    | <tool_response>" in out and "    | The answer is 408.<|im_end|>" in out

    assert main(["episodes", run, "--sample", "0", "--tokens"]) == 0  # the last step; its checkpoint's tokenizer
    tokens = [line.split(maxsplit=3) for line in capsys.readouterr().out.splitlines()
              if line.startswith("    ") and not line.startswith("    |")]
    first = rows[0]["segments"]
    assert [int(t[1]) for t in tokens] == [i for s in first for i in s["ids"]]
    assert [int(t[0]) for t in tokens] == list(range(len(tokens)))
    assert tokens[sum(map(len, (s["ids"] for s in first[:2]))) - 1][1:] == [
        str(trainer.tokenizer.convert_tokens_to_ids("<|im_end|>")), "1", "'<|im_end|>'"]  # the model ended its turn


@pytest.mark.parametrize("args, message", [
    (["--step", "5"], "--step 5: no samples logged at that step; logged steps: 1"),
    (["--sample", "9"], "--sample 9: not logged at step 1; logged samples: 0, 1, 2, 3"),
])
def test_portarl_episodes_names_what_is_not_there(tool_run, capsys, args, message):
    trainer = tool_run[0]
    assert main(["episodes", str(trainer.output_dir), *args]) == 2
    assert capsys.readouterr().err.strip() == f"portarl episodes: {message} (logging.samples_" + (
        "every)" if "step" in args[0] else "count)")


def test_portarl_episodes_refuses_a_tokenizer_that_is_not_the_runs(tool_run, capsys):
    """--tokens decodes with the checkpoint's tokenizer only if it gives back every recorded text."""
    from portarl.assets.tokenizer import CharTokenizer

    trainer = tool_run[0]
    [ckpt] = (trainer.output_dir / "checkpoints").glob("step-*")
    CharTokenizer().save_pretrained(ckpt)  # another tokenizer in its place
    assert main(["episodes", str(trainer.output_dir), "--tokens"]) == 2
    assert "decodes segment 0 of step 1, sample 0 to other text than the run recorded" in capsys.readouterr().err
