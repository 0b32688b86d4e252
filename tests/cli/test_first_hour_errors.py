"""Issue 13, items 6, 7, 9 (version, help): a new user's mistakes end in one line on stderr
and exit 2, for ``portarl train`` and ``portarl sft`` alike, before any training starts.

Subprocesses on purpose: what is checked is what the user sees (exit status, the whole of
stderr, no traceback).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

FAST = ["train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "data.synthetic_size=64",
        "model.hidden_size=32", "model.intermediate_size=64", "train.sft_warmup_steps=0", "train.micro_batch_size=8",
        "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]


def _env():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    return env


def _portarl(*args: str, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "portarl", *args], capture_output=True, text=True, env=_env(),
                          cwd=cwd, timeout=timeout)


def _sets(*items: str) -> list[str]:
    return [x for item in (*FAST, *items) for x in ("--set", item)]


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny model directory saved without its tokenizer, and one with only config.json."""
    from portarl.assets.models import build_tiny

    root = tmp_path_factory.mktemp("models")
    model, _ = build_tiny(hidden_size=32, intermediate_size=64)
    no_tok = root / "no-tokenizer"
    model.save_pretrained(no_tok, safe_serialization=True)
    only_config = root / "only-config"
    only_config.mkdir()
    (only_config / "config.json").write_text((no_tok / "config.json").read_text())
    return {"no-tokenizer": no_tok, "only-config": only_config}


CASES = {
    "steps-0": (["--steps", "0"], "--steps must be an integer > 0"),
    "steps-negative": (["--steps", "-3"], "--steps must be an integer > 0"),
    "top_p-not-a-number": (["--set", "rollout.top_p=abc"], "rollout.top_p"),
    "logging-progress-maybe": (["--set", "logging.progress=maybe"], "logging.progress must be true or false"),
    "yaml-syntax-error": (["--config", "{bad_yaml}"], "YAML syntax error at line 3, column 6"),
    "output-dir-is-a-file": (["--output-dir", "{a_file}"], "is a file, not a directory"),
    "output-dir-under-a-file": (["--output-dir", "{a_file}/out"], "cannot create the output directory"),
    "output-dir-in-sysfs": (["--output-dir", "/sys/portarl-out"], "cannot create the output directory /sys/portarl-out"),
    "model-without-tokenizer": (["--set", "model.path={no-tokenizer}"], "has no tokenizer files"),
    "model-with-only-config": (["--set", "model.path={only-config}"], "has no weights"),
    "absent-device": (["--device", "npu"], "npu"),
    "data-not-utf8": (["--set", "data.path={latin1}"], "{latin1}:2: not valid UTF-8 (byte 0xe9 at byte 16 of the line)"),
    "data-empty-prompt": (["--set", "data.path={blank}"], "{blank}:3: field 'prompt' is empty or only whitespace"),
    # issue 44: the agents recipe on the tiny model is pointed at tiny-chat (it used to be pointed at
    # data.chat_template, which the tiny model refuses too); the warm-up's own file is checked first
    "agents-on-the-tiny-model": (["--config", "{agents}", "--set", "model.path=tiny"], "use model.path: tiny-chat"),
    "sft-path-missing": (["--set", "data.sft_path={a_file}.jsonl", "--set", "train.sft_warmup_steps=2"],
                         "data.sft_path: data file {a_file}.jsonl does not exist"),
}


def _case_args(case, tmp_path, model_dirs) -> tuple[list[str], str, Path]:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train:\n  steps: [3\noptim:\n  lr: 1e-3\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    latin1 = tmp_path / "latin1.jsonl"  # "é" as Latin-1 on line 2
    latin1.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9 1+2=", "answer": "3"}\n')
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'
                     '{"prompt": " \\n\\t ", "answer": "0"}\n')
    fill = {"bad_yaml": str(bad_yaml), "a_file": str(a_file), "latin1": str(latin1), "blank": str(blank),
            "agents": str(Path(__file__).resolve().parents[2] / "examples/agents-tiny.yaml"),
            **{k: str(v) for k, v in model_dirs.items()}}
    args, needle = CASES[case]
    args, needle = [a.format(**fill) for a in args], needle.format(**fill)
    out = tmp_path / "out"
    if "--output-dir" not in args:
        args += ["--output-dir", str(out)]
    if "--device" not in args:
        args += ["--device", "cpu"]
    return [*_sets(), *args], needle, out


@pytest.mark.parametrize("case", sorted(CASES))
def test_train_mistakes_are_one_line_errors(case, tmp_path, model_dirs):
    args, needle, out = _case_args(case, tmp_path, model_dirs)
    proc = _portarl("train", *args)
    line = _assert_one_line_error(proc, needle)
    assert line.startswith("portarl train: ")
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_sft_mistakes_are_the_same_one_line_errors(case, tmp_path, model_dirs, capsys):
    """``sft`` goes through the same checks as ``train`` (in-process here to keep the suite
    fast; an exception would fail the test, so no traceback either)."""
    from portarl.cli import main

    args, needle, out = _case_args(case, tmp_path, model_dirs)
    assert main(["sft", *args]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("portarl sft: ") and needle in err[0], err
    assert not (out / "sft-model").exists()


def test_sft_refuses_to_replace_a_saved_model_without_overwrite(tmp_path):
    out = tmp_path / "run"
    (out / "sft-model").mkdir(parents=True)
    proc = _portarl("sft", "--device", "cpu", "--output-dir", str(out), "--steps", "1", *_sets())
    _assert_one_line_error(proc, "sft-model already exists", "--overwrite")
    done = _portarl("sft", "--device", "cpu", "--output-dir", str(out), "--steps", "2", "--overwrite", *_sets())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "over 2 steps" in done.stdout and (out / "sft-model" / "config.json").exists()


def test_bench_stability_absent_device_fails_before_any_training(tmp_path):
    started = time.monotonic()
    proc = _portarl("bench", "stability", "--runs", "cpu:fp32,npu:bf16", "--steps", "2", "--out", str(tmp_path / "st"))
    line = _assert_one_line_error(proc, "npu:bf16")
    assert line.startswith("portarl bench stability: ")
    # Fail-fast is shown by no run having started (a wall-clock bound would depend on the
    # machine's load): the first run, cpu:fp32, would have created its run directory.
    assert not (tmp_path / "st" / "runs").exists(), "no run may start before every device is checked"
    assert "training" not in proc.stderr
    del started


def test_train_without_the_train_extra_names_it():
    code = ("import sys; sys.modules['yaml'] = None; from portarl.cli import main; sys.exit(main(['train']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    line = _assert_one_line_error(proc, "pip install 'portarl[train]'", "pyyaml")
    assert line.startswith("portarl train: ")


def test_version_and_help_do_not_import_torch():
    code = ("import sys; from portarl.cli import build_parser; import portarl; "
            "print(portarl.__version__, 'torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    import portarl

    assert proc.stdout.split() == [portarl.__version__, "False", "False"]
    version = _portarl("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"portarl {portarl.__version__}"
    helped = _portarl("train", "--help")
    assert helped.returncode == 0 and "--overwrite" in helped.stdout and "--resume" in helped.stdout


def test_resume_where_there_is_no_checkpoint_is_refused_unless_a_new_run_is_asked_for(tmp_path):
    """A mistyped --output-dir with --resume used to start a new run from scratch (issue 33
    item 12); a job script that may run again says --resume-or-start."""
    missing = tmp_path / "typo"
    proc = _portarl("train", "--device", "cpu", "--output-dir", str(missing), "--resume", *_sets())
    _assert_one_line_error(proc, f"--resume: no checkpoint in {missing}/checkpoints", "--resume-or-start")
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _portarl("train", "--device", "cpu", "--output-dir", str(empty), "--resume", *_sets())
    _assert_one_line_error(proc, f"--resume: no checkpoint in {empty}/checkpoints")
    assert not (empty / "metrics.jsonl").exists()
    for _ in range(2):  # a new run, then its continuation
        done = _portarl("train", "--device", "cpu", "--output-dir", str(empty), "--resume-or-start", "--steps", "1",
                        *_sets())
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and (empty / "checkpoints" / "step-000001" / "COMPLETE").exists()


# --------------------------------------------------------------------------------------------
# Issue 44: the user's own code (tools, environments, rewards) and where the async rollout
# workers run are checked with the config, before the model loads: `train` only (`sft` runs
# none of it). Each case runs with the model loader replaced by one that fails the test, so
# a check that still comes after the model load (as every one of these did) cannot pass.

USER_CODE = '''
class Fine:
    def reset(self, row):
        return None

    def step(self, message):
        return None


class NoStep:
    def reset(self, row):
        return None


def make_none():
    Fine()


def undocumented(a: int) -> int:
    return a


def strict(prompts, completions, answer):
    return [0.0] * len(prompts)


def needs_level(prompts, completions, level, **columns):
    return [0.0] * len(prompts)
'''


def _unusable_device() -> str | None:
    """A device type this torch cannot use (cuda on a CPU-only build, npu without torch_npu)."""
    import torch

    from portarl.backends.npu import torch_npu_api

    if not torch.cuda.is_available():
        return "cuda:0"
    return "npu:0" if torch_npu_api.unavailable_reason() is not None else None


USER_CODE_CASES = {
    "env-class-without-step": (["environment=ec_user_code:NoStep"],
                               "environment: 'ec_user_code:NoStep' has no step() method"),
    "env-factory-returns-none": (["environment=ec_user_code:make_none"],
                                 "environment: 'ec_user_code:make_none': the factory returned None"),
    "env-mapping-without-column": (["environment={a: 'ec_user_code:Fine'}"],
                                   "synthetic example 0: the data row has no 'environment' column"),
    "env-mapping-unknown-name": (["environment={a: 'ec_user_code:Fine'}", "data.path={rows}"],
                                 "{rows}:1: the data row names environment 'chess'"),
    "tool-without-docstring": (["tools=['ec_user_code:undocumented']"],
                               "tools[0]: cannot build the JSON schema of 'undocumented'"),
    "multiturn-reward-without-kwargs": (["environment=ec_user_code:Fine", "rewards=[{name: 'ec_user_code:strict'}]"],
                                        "unexpected keyword argument 'conversation' (add **kwargs"),
    "reward-column-missing": (["rewards=[{name: 'ec_user_code:needs_level'}]"],
                              "missing a required argument: 'level'"),
    "reward-needs-an-answer": (["data.path={rows}", "data.answer_field=solution"],
                               "{rows}:1: no answer field (data.answer_field='solution'), which math_exact"),
    "worker-device-unusable": (["rollout.mode=async", "rollout.worker_devices=[{device}]"],
                               "rollout.worker_devices: device {device} requested but"),
}


class ModelLoaded(Exception):
    """The model loader ran: a check that must come before it did not."""


def _user_code_case(case, tmp_path) -> tuple[list[str], str, Path]:
    (tmp_path / "ec_user_code.py").write_text(USER_CODE)
    config = tmp_path / "run.yaml"
    config.write_text("train: {steps: 1}\n")  # its directory is where module:function code is found
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2", "environment": "chess"}\n')
    device = _unusable_device()
    if "{device}" in " ".join(USER_CODE_CASES[case][0]) and device is None:
        pytest.skip("every device type is usable here")
    sets, needle = USER_CODE_CASES[case]

    def fill(text: str) -> str:  # (the sets hold YAML braces: no str.format)
        return text.replace("{rows}", str(rows)).replace("{device}", str(device))

    out = tmp_path / "out"
    args = ["--config", str(config), "--output-dir", str(out), "--device", "cpu"]
    return [*args, *_sets(*map(fill, sets))], fill(needle), out


@pytest.mark.parametrize("case", sorted(USER_CODE_CASES))
def test_user_code_mistakes_are_one_line_errors_before_the_model_loads(case, tmp_path, capsys, monkeypatch):
    import portarl.assets.models
    from portarl.cli import main

    def load(*args, **kwargs):
        raise ModelLoaded(f"the model loaded before the mistake of {case!r} was found")

    monkeypatch.setattr(portarl.assets.models, "build_model", load)
    monkeypatch.delitem(sys.modules, "ec_user_code", raising=False)
    args, needle, out = _user_code_case(case, tmp_path)
    try:
        assert main(["train", *args]) == 2
    finally:
        sys.modules.pop("ec_user_code", None)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("portarl train: ") and needle in err[0], err
    assert not (out / "metrics.jsonl").exists()


def test_an_environment_mapping_over_data_without_the_column_is_one_line_in_the_cli(tmp_path):
    """The real command (it was a traceback once the episodes began)."""
    args, needle, out = _user_code_case("env-mapping-without-column", tmp_path)
    _assert_one_line_error(_portarl("train", *args), needle)
    assert not (out / "metrics.jsonl").exists()
