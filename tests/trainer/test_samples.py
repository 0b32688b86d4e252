"""samples.jsonl, the console line and TensorBoard text (issue 16 item 3)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from portarl.trainer.run.samples import SampleLog, pick


class _Writer:
    def __init__(self):
        self.texts = []

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))


def test_sample_log_rows_console_and_tensorboard(tmp_path, caplog):
    writer = _Writer()
    log = SampleLog(tmp_path, every=3, count=2, writer=writer)
    assert [s for s in range(1, 10) if log.due(s)] == [1, 3, 6, 9]
    assert pick(8, 2) == [0, 4] and pick(3, 5) == [0, 1, 2]
    samples = {"prompts": ["p0", "p1", "p2", "p3"], "completions": ["a", "b", "c", "d"],
               "finished": [True, False, True, True], "rewards": {"math_exact": [1.0, 0.0, None, 1.0]},
               "total": [1.0, 0.0, 0.5, float("nan")], "advantages": [0.5, -0.5, 0.0, 0.1]}
    with caplog.at_level(logging.INFO, logger="portarl.samples"):
        log.write(3, samples)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 3, "sample": 0, "prompt": "p0", "completion": "a", "rewards": {"math_exact": 1.0}, "reward": 1.0,
         "advantage": 0.5, "finish_reason": "stop"},
        {"step": 3, "sample": 2, "prompt": "p2", "completion": "c", "rewards": {"math_exact": None}, "reward": 0.5,
         "advantage": 0.0, "finish_reason": "stop"},
    ]
    assert "sample at step 3: prompt 'p0' -> completion 'a'" in caplog.text
    assert writer.texts[0][0] == "samples" and writer.texts[0][2] == 3 and "**completion**: `c`" in writer.texts[0][1]


def test_a_value_that_is_not_finite_is_null_with_a_reason(tmp_path):
    """JSON has no NaN: the null is explained in the row, never silent (issue 33 item 11)."""
    samples = {"prompts": ["p0"], "completions": ["a"], "finished": [True],
               "rewards": {"judge": [float("inf")], "other": [None]}, "total": [float("nan")], "advantages": [0.5]}
    [row] = SampleLog(tmp_path, every=1, count=1, echo=False).write(1, samples)
    assert row["rewards"] == {"judge": None, "other": None} and row["reward"] is None and row["advantage"] == 0.5
    assert row["nonfinite"] == {"rewards.judge": "inf", "reward": "nan"}
    assert json.loads((tmp_path / "samples.jsonl").read_text()) == row


def test_training_writes_samples_at_the_first_step_and_every_n(make_trainer, tmp_path):
    trainer = make_trainer("train.steps=4", "logging.samples_every=2", "logging.samples_count=3")
    trainer.train()
    rows = [json.loads(line) for line in (trainer.output_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2, 4, 4, 4]
    assert all(r["prompt"].endswith("=") and set(r["rewards"]) == {"math_exact", "format"} for r in rows)


def test_a_single_turn_row_is_its_prompt_and_completion_ids(make_trainer, monkeypatch):
    """Token truth (issue 44): the segments are the ids the trainer scored, the prompt as the
    model saw it (the built-in tokenizer's <bos> included); the loss covers the completion."""
    from scored_rows import capture_scored_batches, segment_mismatch

    batches = capture_scored_batches(monkeypatch)
    trainer = make_trainer("train.steps=1", "logging.samples_every=1", "logging.samples_count=2")
    trainer.train()
    rows = [json.loads(line) for line in (trainer.output_dir / "samples.jsonl").read_text().splitlines()]
    decode = lambda ids: trainer.tokenizer.decode(list(ids), skip_special_tokens=False)  # noqa: E731
    for row in rows:
        assert segment_mismatch(row, batches[0], decode) is None
        assert [(s["role"], s["loss_mask"]) for s in row["segments"]] == [("prompt", 0), ("model", 1)]
        assert row["prompt"].startswith("<bos>") and row["prompt"].endswith("=")


def test_portarl_episodes_reads_rows_written_before_segments(tmp_path, capsys):
    from portarl.cli import main

    old = {"step": 2, "sample": 0, "prompt": "2+2=", "completion": "4", "rewards": {}, "reward": 1.0,
           "advantage": 0.5, "finish_reason": "stop"}
    (tmp_path / "samples.jsonl").write_text(json.dumps(old) + "\n" + '{"step": 3, "sam')  # cut short by a crash
    assert main(["episodes", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        "step 2, sample 0: finish stop, reward 1.0, advantage 0.5",
        "  (no token ids: this row was written before samples.jsonl carried segments)",
        "  prompt", "    | 2+2=", "  assistant (? tokens)", "    | 4"]
    assert "skipped 1 line(s) of samples.jsonl that are not JSON" in captured.err
    assert main(["episodes", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    # JSON only: quick where the run directory was copied to (no torch, no transformers)
    code = (f"import sys; from portarl.cli import main; code = main(['episodes', {str(tmp_path)!r}]); "
            "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split()[-3:] == ["0", "False", "False"], proc.stderr
