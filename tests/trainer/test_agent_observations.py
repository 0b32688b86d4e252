"""Bounded observations (issue 44): a tool result or an environment observation is cut at
``rollout.max_tool_tokens`` with a marker the model reads, counted; an episode never
outgrows the engine's context or ``rollout.max_episode_tokens``; no warning advises a token
budget past the model's context. Before: a tool returning 10 MB made a 10 M-token episode on
the tiny model (4096 positions) and the update asked for terabytes.

The 10 MB tests check each episode's length after the rollout and before the update, so a
regression fails there, in about half a minute, instead of reaching the update."""

from __future__ import annotations

import logging
import re
import tracemalloc
import types

import pytest

from agent_tiny import ScriptedRollout, agent_tokenizer, call_text, tiny_model
from agent_tools import FLOOD
from portarl.assets.data import Example
from portarl.multiturn.observations import MARKER, ObservationCap
from portarl.assets.tokenizer import CharTokenizer, TextCodec
from portarl.trainer import GRPOTrainer, TrainConfig
from portarl.trainer.config import ConfigError
from portarl.trainer.phases import micro_batches
from portarl.trainer.phases.rollout import run_rollout
from trainer_fast import fast_config

CONTEXT = 4096  # tiny_model's max_position_embeddings
CAP = TrainConfig().rollout.max_tool_tokens
#: The rendered observation around the kept tokens: the marker line and the template's
#: turn tags (<|im_end|>, <|im_start|>user, <tool_response> ...): 85 tokens with this
#: near character-level tokenizer (measured); an uncut 10 MB result is millions.
WRAPPING = 120
#: Python memory (tracemalloc) a rollout with a 10 MB tool output may peak at: the output
#: held a few times (the tool's string, its JSON round trip; measured: 19 MiB). Tokenised
#: whole, its token offsets alone take hundreds of MiB.
PEAK_BYTES = 80 * 2**20
ANSWER = "The answer is 408."
TRUNCATED = re.compile(r"\[\.\.\. (\d+) characters truncated \.\.\.\]")


def _trainer(tmp_path, script, *overrides):
    tok = agent_tokenizer()
    model = tiny_model(len(tok))
    cfg = fast_config(tmp_path, "rollout.group_size=2", "train.prompts_per_step=1", "rollout.max_turns=3",
                      "loss.kl_coef=0", *overrides)
    rows = [Example([{"role": "user", "content": "What is 12*34?"}], "408", {"answer": "408"}, "row 1")]
    return GRPOTrainer(model, tok, None, rows, cfg, device="cpu", rollout_engine=ScriptedRollout(model, tok, script))


def _assert_within_context(rollout) -> None:
    lengths = [len(p) + len(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids)]
    assert max(lengths) <= CONTEXT, f"episodes of {lengths} tokens on a {CONTEXT}-position model"


def _appended_text(trainer, rollout, i: int = 0) -> str:
    """What was appended to episode ``i`` between the model's turns, as the model reads it."""
    ids = [t for t, mine in zip(rollout.completion_ids[i], rollout.model_mask[i]) if not mine]
    return trainer.tokenizer.decode(ids)


def _rollout_peak(trainer):
    """The step's rollout phase and the Python memory it peaked at (the update's tensors are
    bounded by the episodes' lengths, which the tests check)."""
    tracemalloc.start()
    try:
        phase = run_rollout(trainer, 1)
        return phase, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _advised(caplog) -> list[int]:
    return [int(n) for r in caplog.records for n in re.findall(r"at least (\d+)", r.getMessage())]


@pytest.mark.parametrize("isolation, cap", [("none", CAP), ("process", 64)])
def test_a_10mb_tool_output_is_cut_and_a_step_trains_with_bounded_memory(tmp_path, caplog, isolation, cap):
    trainer = _trainer(tmp_path, [call_text("flood"), ANSWER], "tools=['agent_tools:flood']",
                       "rewards=[{name: math_exact}]", f"rollout.tool_isolation={isolation}",
                       f"rollout.max_tool_tokens={cap}",
                       "train.max_tokens_per_micro_batch=256")  # below the episodes: its warning's advice is read
    caplog.set_level(logging.WARNING, logger="portarl.train")  # its own level too (another test may have raised it)
    try:
        phase, peak = _rollout_peak(trainer)
        _assert_within_context(phase.rollout)
        assert peak < PEAK_BYTES, f"the rollout peaked at {peak / 2**20:.0f} MiB of Python memory"
        episode = phase.rollout.episodes[0]
        result = episode["messages"][1]
        assert result["content"].startswith("<tool_response>\nSTART lorem ipsum")  # middle cut: both ends kept
        assert result["content"].endswith(" END\n</tool_response>")
        assert 0 < result["tokens"] <= cap + WRAPPING
        assert len(TRUNCATED.findall(result["content"])) == 1
        assert int(TRUNCATED.search(result["content"]).group(1)) > len(FLOOD) - 20 * cap
        assert TRUNCATED.search(_appended_text(trainer, phase.rollout))  # the marker is in the tokens the model reads
        assert episode["finish"] == "stop" and episode["truncated_observations"] == 1
        assert phase.metrics["agent/truncated_observations"] == 1  # per episode

        metrics = trainer.train_step()
        assert metrics["skipped"] == 0 and metrics["agent/truncated_observations"] == 1
        assert _advised(caplog) and max(_advised(caplog)) <= CONTEXT
    finally:
        trainer.close()


def test_a_10mb_environment_observation_and_reset_text_are_cut_and_a_step_trains(tmp_path):
    trainer = _trainer(tmp_path, ["one", "two", "three"], "environment=agent_tools:FloodEnv",
                       "rewards=[{name: environment}]", "rollout.max_tool_tokens=64")
    try:
        phase, peak = _rollout_peak(trainer)
        _assert_within_context(phase.rollout)
        assert peak < PEAK_BYTES, f"the rollout peaked at {peak / 2**20:.0f} MiB of Python memory"
        prompt = trainer.tokenizer.decode(phase.rollout.prompt_ids[0])
        assert "What is 12*34?\n\nSTART lorem" in prompt and TRUNCATED.search(prompt)  # the reset text, cut
        episode = phase.rollout.episodes[0]
        assert [m["role"] for m in episode["messages"]] == ["assistant", "user"] * 2 + ["assistant"]
        observation = episode["messages"][1]
        assert TRUNCATED.search(observation["content"]) and 0 < observation["tokens"] <= 64 + WRAPPING
        assert TRUNCATED.search(_appended_text(trainer, phase.rollout))
        assert episode["finish"] == "done" and episode["truncated_observations"] == 3  # reset, two steps

        metrics = trainer.train_step()
        assert metrics["skipped"] == 0 and metrics["agent/truncated_observations"] == 3
        assert metrics["reward/environment"] == 3.0
    finally:
        trainer.close()


@pytest.mark.parametrize("bound, limit", [(f"rollout.max_tool_tokens={CONTEXT * 4}", CONTEXT),
                                          ("rollout.max_episode_tokens=300", 300)])
def test_an_observation_past_the_room_left_ends_the_episode_unappended(tmp_path, bound, limit):
    """The tool's 6000 tokens pass the cap but not the context (or the episode budget): the
    episode ends (budget) with the result shown in the sample log, cut, and not appended."""
    trainer = _trainer(tmp_path, [call_text("echo", n=6000), ANSWER], "tools=['agent_tools:echo']",
                       "rewards=[{name: math_exact}]", bound)
    try:
        rollout = run_rollout(trainer, 1).rollout
        _assert_within_context(rollout)
        assert max(map(len, rollout.completion_ids)) <= limit
        episode = rollout.episodes[0]
        assert episode["finish"] == "budget" and episode["turns"] == 1
        assert len(episode["messages"]) == 1  # the model's call; its result was never read
        result = episode["unread"][0]
        assert TRUNCATED.search(result["content"]) and len(result["content"]) < 6000
        assert rollout.model_mask[0] == [True] * len(rollout.completion_ids[0])  # nothing appended
    finally:
        trainer.close()


# ----------------------------------------------------------------------- the cut itself
class _Recording:
    """A fast tokenizer that remembers how many characters it was given each call."""

    is_fast = True

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)


@pytest.mark.parametrize("side, head, tail", [("middle", 256, 256), ("end", 512, 0), ("start", 0, 512)])
def test_the_cut_keeps_the_configured_side_and_never_tokenises_the_whole_text(side, head, tail):
    tok = agent_tokenizer()
    recording = _Recording(tok)
    kept, cut = ObservationCap(types.SimpleNamespace(tokenizer=recording), 512, side).cut(FLOOD)
    assert cut and max(recording.lengths) < len(FLOOD) // 100
    before, marker, after = kept.partition(MARKER.split("{")[0])
    assert marker and FLOOD.startswith(before) and FLOOD.endswith(after.partition("\n")[2])
    assert len(tok(before, add_special_tokens=False)["input_ids"]) in range(head - 2, head + 1)
    shown = after.partition("\n")[2]
    assert len(tok(shown, add_special_tokens=False)["input_ids"]) in range(tail - 2, tail + 1)
    assert int(TRUNCATED.search(kept).group(1)) == len(FLOOD) - len(before) - len(shown)


def test_a_short_text_is_kept_whole_and_a_tokenizer_without_offsets_cuts_too():
    codec = TextCodec(agent_tokenizer())
    assert ObservationCap(codec, 512).cut("x" * 500) == ("x" * 500, False)
    kept, cut = ObservationCap(codec, 512).cut("x" * 600)
    assert cut and kept == "x" * 256 + MARKER.format(removed=88) + "x" * 256
    chars = TextCodec(CharTokenizer())  # one token per character, no offsets: the kept tokens are decoded
    kept, cut = ObservationCap(chars, 10, "end").cut("START " + "abc " * 10_000)
    assert cut and kept == "START abc " + MARKER.format(removed=40_006 - 10)


def test_no_warning_advises_a_token_budget_past_the_models_context(caplog):
    """The tester's case: a 2,500,283-token row on a 2048-position model (before: "raise the
    budget to at least 2500283")."""
    trainer = types.SimpleNamespace(model=types.SimpleNamespace(config=types.SimpleNamespace(
        max_position_embeddings=2048)), budget_warned=False)
    with caplog.at_level(logging.WARNING, logger="portarl.train"):
        micro_batches._warn_over_budget(trainer, 16384, [40, 50], [2_500_243, 100])
    assert "longer than the model's context (2048 positions)" in caplog.text
    assert not [n for n in map(int, re.findall(r"\d+", caplog.text)) if 16384 < n < 2_500_283]
    assert not _advised(caplog)
    trainer.budget_warned = False
    with caplog.at_level(logging.WARNING, logger="portarl.train"):
        micro_batches._warn_over_budget(trainer, 512, [40], [1000])  # within the context: advice as before
    assert _advised(caplog) == [1040]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.max_tool_tokens=0"], "rollout.max_tool_tokens must be an integer > 0, got 0"),
    (["rollout.max_tool_tokens=null"], "rollout.max_tool_tokens must be an integer, got None"),
    (["rollout.tool_truncate_side=left"], "rollout.tool_truncate_side must be one of middle, end, start, got 'left'"),
])
def test_the_cap_settings_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig.load(None, overrides)
