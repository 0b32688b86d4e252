"""Smoke runs of ``portarl bench step`` (tiny: 2 steps, one round); timings are not asserted,
only that every number is produced and consistent (phases within the step, equal threads)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from portarl.bench import step as bench_step  # noqa: E402
from portarl.bench import step_work  # noqa: E402
from portarl.bench.step_work import Work  # noqa: E402
from portarl.cli import main  # noqa: E402

TINY = ["--steps", "2", "--warmup", "1", "--rounds", "1", "--threads", "1"]


def _check_side(m: dict) -> None:
    assert m["cpu_s"] > 0 and m["wall_s"] > 0 and m["peak_rss_mib"] > 50
    for kind in ("cpu", "wall"):
        rollout, scoring, update = (m[f"{p}_{kind}_s"] for p in ("rollout", "scoring", "update"))
        assert rollout > 0 and scoring >= 0 and update > 0
        assert rollout + scoring <= m[f"{kind}_s"] + 1e-9


def test_bench_step_portarl(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", *TINY, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    _check_side(data["summary"]["portarl"])
    assert "trl" not in data["summary"] and "ratio_cpu" not in data["summary"]
    run = data["rounds"][0]["portarl"]
    assert run["torch_threads"] == 1 and len(run["steps"]) == 2
    assert "process CPU" in out.with_suffix(".md").read_text() and "portarl bench step" in capsys.readouterr().out


def test_bench_step_refuses_vs_trl_without_trl(monkeypatch, capsys):
    monkeypatch.setattr(bench_step, "trl_unavailable_reason", lambda: "trl is not installed")
    assert main(["bench", "step", "--vs", "trl", *TINY]) == 2
    assert "trl is not installed" in capsys.readouterr().err


def test_bench_step_checks_its_arguments(capsys):
    assert main(["bench", "step", "--steps", "2", "--warmup", "2"]) == 2
    assert main(["bench", "step", "--threads", "0"]) == 2
    assert "--warmup < --steps" in capsys.readouterr().err


@pytest.mark.skipif(bench_step.trl_unavailable_reason() is not None, reason="trl is not installed (portarl[bench])")
def test_bench_step_vs_trl(tmp_path):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--vs", "trl", *TINY, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for side in ("portarl", "trl"):
        _check_side(data["summary"][side])
        assert data["rounds"][0][side]["torch_threads"] == 1
    row = data["rounds"][0]
    steps = sorted((s for side in ("portarl", "trl") for s in row[side]["steps"]), key=lambda s: s["started_unix"])
    for before, after in zip(steps, steps[1:]):  # the sides stepped in turn, never at once
        assert before["started_unix"] + before["wall_s"] <= after["started_unix"]
    assert row["ratio_cpu"] == pytest.approx(row["portarl_median"]["cpu_s"] / row["trl_median"]["cpu_s"])
    assert "Median ratio" in out.with_suffix(".md").read_text()


FAKE_WORKER = """
import json, sys, time
from portarl.bench.step_side import RESULT, gate
impl, steps = sys.argv[1], int(sys.argv[2])
if impl == "broken":
    sys.exit("broken worker: no model for you")
records = []
for _ in range(steps):
    gate()
    t0, w0 = time.time(), time.perf_counter()
    while time.perf_counter() - w0 < 0.02:
        pass
    records.append({"impl": impl, "started_unix": t0, "wall_s": time.perf_counter() - w0})
print(RESULT + " " + json.dumps({"steps": records}), flush=True)
"""


def _fake_workers(monkeypatch):
    import sys

    monkeypatch.setattr(bench_step, "worker_command",
                        lambda impl, steps, threads, work: [sys.executable, "-c", FAKE_WORKER, impl, str(steps)])


def test_two_sides_take_their_steps_in_turn_swapping_who_goes_first(monkeypatch):
    """The driver's protocol (stand-in workers, no TRL needed): one process steps while the
    other waits, never both at once, and the first side swaps every step."""
    _fake_workers(monkeypatch)
    results = bench_step.run_in_turn(["a", "b"], 4, 1, Work())
    steps = sorted((s for r in results.values() for s in r["steps"]), key=lambda s: s["started_unix"])
    assert [s["impl"] for s in steps] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    for before, after in zip(steps, steps[1:]):
        assert before["started_unix"] + before["wall_s"] <= after["started_unix"]
    alone = bench_step.run_in_turn(["a"], 2, 1, Work())["a"]  # a side run on its own is not gated
    assert len(alone["steps"]) == 2


def test_a_worker_that_dies_is_reported_with_its_error(monkeypatch):
    _fake_workers(monkeypatch)
    with pytest.raises(RuntimeError, match="(?s)worker broken failed.*no model for you"):
        bench_step.run_in_turn(["a", "broken"], 2, 1, Work())


# ---------------------------------------------------------------- --model PATH: a real model's directory
#: A template of the character tokenizer's own characters (it has no <|im_start|>): enough
#: to make the prompts conversations that both sides render through apply_chat_template.
CHAR_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] + ': ' + m['content'] + '. ' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'a: ' }}{% endif %}")
SMALL_WORK = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "6", "--micro-batch-size", "8"]


@pytest.fixture
def model_dir(tmp_path):
    """A tiny Qwen2 saved as a Hugging Face directory with a chat-template tokenizer."""
    tok = step_work.tokenizer()
    tok.chat_template = CHAR_TEMPLATE
    directory = tmp_path / "model"
    step_work.model(seed=3).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.skipif(bench_step.trl_unavailable_reason() is not None, reason="trl is not installed (portarl[bench])")
def test_bench_step_vs_trl_on_a_model_directory(model_dir, tmp_path):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--vs", "trl", "--model", str(model_dir), *TINY, *SMALL_WORK,
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    work = data["work"]
    assert (work["model_path"], work["prompts_per_step"], work["group_size"], work["max_new_tokens"],
            work["micro_batch_size"]) == (str(model_dir), 4, 4, 6, 8)
    assert work["gradient_checkpointing"] is True and work["beta"] == 0.001  # --model's README defaults
    assert work["trl_batching"] == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
                                    "steps_per_generation": 2, "num_generations": 4, "num_iterations": 1}
    assert work["in_turn"] == "sides"
    row = data["rounds"][0]
    for side in ("portarl", "trl"):
        _check_side(data["summary"][side])
        run = row[side]
        assert run["gradient_checkpointing"] is True and len(run["steps"]) == 2
        assert 50 < run["baseline_rss_mib"] <= run["peak_rss_mib"]
        assert run["rss_increase_mib"] == pytest.approx(run["peak_rss_mib"] - run["baseline_rss_mib"])
    first, second = (row[side]["steps"] for side in row["order"])  # one side after the other, never at once
    assert first[-1]["started_unix"] + first[-1]["wall_s"] <= second[0]["started_unix"]
    assert data["summary"]["ratio_peak_rss"] == pytest.approx(
        data["summary"]["portarl"]["peak_rss_mib"] / data["summary"]["trl"]["peak_rss_mib"])
    assert f"--model {model_dir}" in data["command"] and "--schedule sides" in data["command"]
    md = out.with_suffix(".md").read_text()
    for text in ("4 prompts x 4 samples", "6 new tokens", "micro-batches of 8 rows", "gradient checkpointing on",
                 "per_device_train_batch_size 8, gradient_accumulation_steps 2", "one after the other",
                 "after load", "peak RSS"):
        assert text in md, text


def test_bench_step_model_checkpointing_off_is_applied(model_dir, tmp_path):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--model", str(model_dir), *TINY, *SMALL_WORK, "--gradient-checkpointing", "off",
                 "--beta", "0", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["work"]["gradient_checkpointing"] is False and data["work"]["beta"] == 0
    assert data["rounds"][0]["portarl"]["gradient_checkpointing"] is False
    _check_side(data["summary"]["portarl"])


@pytest.mark.parametrize("argv, message", [
    (["--model", "{tmp}/missing"], "--model {tmp}/missing: not a Hugging Face model directory"),
    (["--model", "{tmp}/missing.gguf"], "--model {tmp}/missing.gguf: no such .gguf file"),
    (["--model", "package:no_such_package_xyz/m.gguf"], "is not installed"),
    (["--micro-batch-size", "7"], "--micro-batch-size 7 does not divide the 64 samples"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--max-new-tokens", "100"], "the tiny model holds 128 positions"),
    (["--schedule", "sides"], "--schedule sides orders the sides of --vs trl / --async"),
    (["--async"], "--async needs --model PATH"),
    (["--reward", "math_exact", "--data", "{tmp}/none.jsonl"], "--data needs --model"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--tiny-hidden", "66"], "a hidden size that is a positive multiple of 4"),
    (["--tiny-layers", "0"], "use >= 1 layer"),
    (["--model", "m.gguf", "--tiny-layers", "4"], "leave them out with --model"),
])
def test_bench_step_refuses_bad_work(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["bench", "step", *TINY, *argv]) == 2
    assert message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err


def test_bench_step_tiny_shape_reaches_both_sides(tmp_path):
    """--tiny-layers / --tiny-hidden: the worker's model has that shape, and the record says so."""
    from types import SimpleNamespace

    from portarl.bench import step_work

    work = step_work.work_from_args(SimpleNamespace(tiny_layers=4, tiny_hidden=128))
    assert step_work.work_from_args(bench_step_args(work.argv())) == work  # a worker reads the same work back
    model = step_work.load(work)[0].config
    assert (model.num_hidden_layers, model.hidden_size, model.intermediate_size) == (4, 128, 384)
    assert "hidden 128, 4 layers" in work.describe()["model"] and "--tiny-hidden 128" in " ".join(work.argv())
    out = tmp_path / "step.json"
    assert main(["bench", "step", *TINY, "--tiny-layers", "3", "--tiny-hidden", "32", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "hidden 32, 3 layers" in data["work"]["model"] and "--tiny-layers 3 --tiny-hidden 32" in data["command"]


def bench_step_args(argv):
    import argparse

    from portarl.bench.step_work import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(argv)


def test_tiny_defaults_are_unchanged():
    """Without --model the work is the earlier results' (8 x 8 samples, 8 new tokens, one
    64-row micro-batch, no checkpointing, no reference), and TRL gets one micro-batch."""
    from types import SimpleNamespace

    from portarl.bench.step_work import work_from_args

    work = work_from_args(SimpleNamespace())
    assert work == Work() and (work.samples, work.max_new_tokens, work.gradient_checkpointing, work.beta) == (64, 8, False, 0.0)
    assert work.trl_batching()["gradient_accumulation_steps"] == 1
    readme = work_from_args(SimpleNamespace(model="m.gguf"))
    assert (readme.samples, readme.max_new_tokens, readme.micro_batch_size, readme.gradient_checkpointing,
            readme.beta) == (128, 64, 64, True, 0.001)
    assert readme.trl_batching()["gradient_accumulation_steps"] == 2


@pytest.mark.skipif(bench_step.trl_unavailable_reason() is not None, reason="trl is not installed (portarl[bench])")
def test_bench_step_vs_trl_on_a_gguf_file(tmp_path):
    """A .gguf model with a KL reference: TRL would load its reference from the policy's
    directory, which a GGUF file does not have; the bench gives it the same file's weights."""
    pytest.importorskip("gguf", reason="GGUF loading needs the gguf package (pip install 'portarl[gguf]')")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    try:
        from gguf_tiny import write_tiny_gguf
    finally:
        sys.path.pop(0)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--vs", "trl", "--model", str(path), "--steps", "1", "--warmup", "0", "--rounds", "1",
                 *SMALL_WORK, "--beta", "0.01", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["work"]["beta"] == 0.01 and data["work"]["model_path"] == str(path)
    for side in ("portarl", "trl"):
        assert data["summary"][side]["cpu_s"] > 0 and data["rounds"][0][side]["gradient_checkpointing"] is True


def test_bench_step_async_side_on_a_model_directory(model_dir, tmp_path):
    """--async: portarl in rollout.mode=async beside colocated, on the same two threads (one
    each for its trainer and worker), the prompts and answers of a JSONL file and the
    math_exact reward; samples/s and reward per sample for both; the async side's CPU is its
    trainer's plus its worker's."""
    data_file = tmp_path / "data.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1)})
                                 + "\n" for a in range(8)))
    out = tmp_path / "step.json"
    argv = ["bench", "step", "--async", "--model", str(model_dir), "--steps", "3", "--warmup", "1", "--rounds", "1",
            "--threads", "2", *SMALL_WORK, "--beta", "0", "--reward", "math_exact", "--data", str(data_file),
            "--temperature", "0.7", "--out", str(out)]
    for bad, says in ((["--threads", "1"], "use --threads 2"), (["--warmup", "0"], "--async needs --warmup 1")):
        assert main([*argv, *bad]) == 2
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["work"]["reward"].startswith("math_exact") and data["work"]["data"] == str(data_file)
    assert data["work"]["temperature"] == 0.7
    row = data["rounds"][0]
    assert row["portarl"]["torch_threads"] == 2 and row["portarl-async"]["torch_threads"] == 1
    for side in ("portarl", "portarl-async"):
        summary = data["summary"][side]
        assert summary["samples_per_s"] == pytest.approx(16 / summary["wall_s"])
        assert 0 <= summary["reward_mean"] <= 1
    for step in row["portarl-async"]["steps"]:
        assert step["worker_cpu_s"] > 0 and step["cpu_s"] == pytest.approx(step["trainer_cpu_s"] + step["worker_cpu_s"])
    assert "--async" in data["command"] and "--schedule sides" in data["command"]
    md = out.with_suffix(".md").read_text()
    assert "| portarl-async |" in md and "samples/s" in md and "reward per sample" in md
