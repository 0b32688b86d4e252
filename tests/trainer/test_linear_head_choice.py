"""``train.linear_head``: which fused linear log-probs head a run scores with on a GPU
(portarl.trainer.phases.linear_head), decided at the run's start and logged. On this CPU
the decision runs on CPU operands (nothing is timed there: ``tile`` unless forced); on a
GPU the same code times the heads (tests/parity/test_linear_heads.py holds the choice
logic, the cache and the log line)."""

from __future__ import annotations

import pytest

from portarl.backends.cuda import linear_heads
from portarl.trainer.config import ConfigError
from portarl.trainer.phases.linear_head import decide, pick_linear_head


@pytest.fixture(autouse=True)
def _fresh_choice():
    linear_heads.reset()
    yield
    linear_heads.reset()


def test_a_forced_head_is_the_runs_and_its_line_says_so(make_trainer, monkeypatch):
    monkeypatch.delenv(linear_heads.HEAD_ENV, raising=False)
    trainer = make_trainer("train.linear_head=split")
    line = decide(trainer, trainer.device)
    assert line == "linear log-probs head on cpu (float32, H=32, V=79): split (forced)", line
    weight = trainer.model.get_output_embeddings().weight
    assert linear_heads.head_for(weight[:1], weight) == "split"  # the op takes it for the policy's shape
    linear_heads.reset()
    trainer = make_trainer("train.linear_head=auto")
    assert decide(trainer, trainer.device).endswith(": tile (cached or another rank's choice)")


def test_the_environment_wins_over_the_config(make_trainer, monkeypatch):
    monkeypatch.setenv(linear_heads.HEAD_ENV, "cublas")
    trainer = make_trainer("train.linear_head=split")
    assert decide(trainer, trainer.device).endswith(": cublas (forced)")


def test_off_a_gpu_nothing_is_decided_or_logged(make_trainer):
    trainer = make_trainer("train.linear_head=split")
    assert pick_linear_head(trainer) is None
    trainer.train()
    assert "linear_head" not in (trainer.output_dir / "events.jsonl").read_text()


def test_a_bad_head_is_refused_naming_the_field(make_trainer):
    with pytest.raises(ConfigError, match=r"train.linear_head must be auto, split, cublas or tile, got 'fast'"):
        make_trainer("train.linear_head=fast")
