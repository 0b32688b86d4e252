"""What a new user hit from a fresh clone, held: tracebacks turned into one line (a reward
with the wrong signature, ``rollout.engine=vllm`` without vLLM, bench kernels arguments),
silent or wrong behaviour made true (``--resume`` with fewer steps than done, the export
message, the exported tokenizer, file modes, ``data.path`` relative to its config, summary
labels), and the help texts.

Subprocesses where what is checked is what the user sees (exit status, all of stderr);
in-process calls of :func:`portarl.cli.main` elsewhere, to keep the suite fast.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from portarl import cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FAST = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "data.synthetic_size=64",
        "model.hidden_size=32", "model.intermediate_size=64", "train.sft_warmup_steps=0", "train.micro_batch_size=8",
        "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]


def _sets(*items: str) -> list[str]:
    return [x for item in (*FAST, *items) for x in ("--set", item)]


def _portarl(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "portarl", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _one_line(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = _lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- tracebacks -> one line
def test_reward_with_the_wrong_signature_is_one_line_naming_it(tmp_path):
    (tmp_path / "badreward.py").write_text("def bad_sig(x):\n    return 0.0\n")
    (tmp_path / "c.yaml").write_text('rewards:\n  - {name: "badreward:bad_sig", weight: 1.0}\n')
    proc = _portarl("train", "--config", str(tmp_path / "c.yaml"), "--device", "cpu", "--steps", "1",
                    "--output-dir", str(tmp_path / "out"), *_sets())
    line = _one_line(proc, 2, "badreward:bad_sig", "wrong signature")
    assert line.startswith("portarl train: ")


def test_a_reward_that_raises_is_reported_once(tmp_path):
    (tmp_path / "boom.py").write_text("def boom(prompt, completion, answer):\n    raise ValueError('boom')\n")
    (tmp_path / "c.yaml").write_text('rewards:\n  - {name: "boom:boom", weight: 1.0}\n')
    proc = _portarl("train", "--config", str(tmp_path / "c.yaml"), "--device", "cpu", "--steps", "1",
                    "--output-dir", str(tmp_path / "out"), *_sets())
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("raised ValueError: boom") == 1, proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_is_one_line(tmp_path):
    proc = _portarl("train", "--device", "cpu", "--steps", "1", "--output-dir", str(tmp_path / "out"),
                    *_sets("rollout.engine=vllm"))
    _one_line(proc, 2, "rollout.engine=vllm", "pip install vllm")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("value", ["0", "-3"])
def test_bench_kernels_repeats_below_one_is_refused_by_the_subcommand(value):
    proc = _portarl("bench", "kernels", "--repeats", value)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "portarl bench kernels" in proc.stderr and "--repeats" in proc.stderr and ">= 1" in proc.stderr


@pytest.mark.parametrize("args, needle", [
    (["--ops", "linear_logprobs", "--shapes", "64x512"], "NxHxV"),
    (["--ops", "logprobs", "--shapes", "8x16x32"], "NxV"),
    (["--ops", "logprobs", "linear_logprobs", "--shapes", "64x512"], "no NxHxV shape"),
    (["--out", "{dir}"], "is a directory"),
])
def test_bench_kernels_bad_arguments_are_refused_before_any_run(args, needle, tmp_path, capsys):
    args = [a.format(dir=tmp_path) for a in args]
    assert cli.main(["bench", "kernels", "--device", "cpu", "--repeats", "1", *args]) == 2
    captured = capsys.readouterr()
    err = _lines(captured.err)
    assert len(err) == 1 and err[0].startswith("portarl bench kernels: ") and needle in err[0], err
    assert captured.out == "", "nothing may be benchmarked before the arguments are checked"


# ---------------------------------------------------------------- silent / wrong -> true
def test_resume_with_fewer_steps_than_done_is_refused_with_both_numbers(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--device", "cpu", "--output-dir", str(out), "--steps", "3", *_sets()]) == 0
    saved = (out / "config.yaml").read_text()
    capsys.readouterr()
    assert cli.main(["train", "--device", "cpu", "--output-dir", str(out), "--steps", "2", "--resume", *_sets()]) == 2
    err = _lines(capsys.readouterr().err)[-1]
    assert "train.steps=2" in err and "already done 3 steps" in err, err
    assert (out / "config.yaml").read_text() == saved, "a refused resume must not rewrite config.yaml"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_export_message_modes_and_a_loadable_tokenizer(tmp_path, capsys):
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    assert cli.main(["train", "--device", "cpu", "--output-dir", str(run), "--steps", "1", *_sets()]) == 0
    capsys.readouterr()
    out = tmp_path / "exported"
    assert cli.main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    message = capsys.readouterr().out
    assert "full weights" in message and "LoRA" not in message, message
    expected = 0o666 & ~_umask()
    for directory in (out, sorted((run / "checkpoints").glob("step-*"))[-1]):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir() if p.is_file()}
        assert set(modes.values()) == {expected}, modes
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = tok("1+2=")["input_ids"]
    from portarl.assets.tokenizer import CharTokenizer

    assert ids == CharTokenizer().encode("1+2=")
    assert tok.decode(ids, skip_special_tokens=True) == "1+2="
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_lora_export_says_merged_and_eval_arith_hints_to_export(tmp_path, capsys):
    pytest.importorskip("peft")
    run = tmp_path / "run"
    assert cli.main(["train", "--device", "cpu", "--output-dir", str(run), "--steps", "1",
                     *_sets("model.lora.r=4")]) == 0
    capsys.readouterr()
    assert cli.main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "exported")]) == 0
    assert "LoRA adapter merged" in capsys.readouterr().out
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    env = {**os.environ}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "eval_arith.py"), "--model", str(ckpt)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "LoRA checkpoint" in proc.stderr and "portarl export" in proc.stderr, proc.stderr


def test_data_path_in_a_config_is_relative_to_the_config_file(tmp_path, monkeypatch):
    from portarl.trainer.config import TrainConfig

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "c.yaml").write_text("data:\n  path: data/q.jsonl\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert TrainConfig.load(conf / "c.yaml").data.path == str(conf / "data" / "q.jsonl")
    # given on the command line, a relative path is the working directory's
    assert TrainConfig.load(conf / "c.yaml", ["data.path=mine.jsonl"]).data.path == "mine.jsonl"
    # the example runs from anywhere
    example = TrainConfig.load(REPO / "examples" / "smollm2-arith.yaml")
    assert Path(example.data.path).is_file(), example.data.path


def test_train_default_output_dir_is_not_the_demos():
    from portarl.trainer.config import TrainConfig

    assert TrainConfig().output_dir == "runs/train"
    assert "runs/demo" in (REPO / "Makefile").read_text()


def test_summary_says_means_of_the_last_steps():
    from portarl.trainer.run.logger import summarize

    rows = [{"step": i, "reward/mean": 0.1, "kl": float(i), "grad_norm": 1.0} for i in range(1, 21)]
    text = summarize(rows)
    assert "kl (mean of last 10 steps): 1.550e+01" in text and "(last)" not in text, text


# ---------------------------------------------------------------- help
def test_help_texts_describe_each_command():
    top = _portarl("--help").stdout
    assert "``" not in top and "RL post-training" in top and "exit status" in top
    bench = _portarl("bench", "--help").stdout
    assert "step" in bench and "stability" in bench and "kernels" in bench
    kernels = _portarl("bench", "kernels", "--help").stdout
    assert "linear_logprobs" in kernels
    for described in ("auto (default), cuda", "precisions to time", "timed repetitions per case"):
        assert described in " ".join(kernels.split()), described  # --device, --dtypes, --repeats
    sft = _portarl("sft", "--help").stdout
    train = _portarl("train", "--help").stdout
    assert "sft-model" in sft and "Supervised" in sft and "GRPO" in train and "runs/train" in train
