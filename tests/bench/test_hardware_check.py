"""portarl hardware-check: its usage errors, its stage runner (limits, failures, the output
folder's contract), and the readers behind its summary. The whole command runs on the CPU
in .ci/run (`make hardware-check-quick`); these tests hold the parts a CPU run cannot reach:
a stage that hangs, a stage whose device is absent, a failing hardware test, a run that
went non-finite."""

from __future__ import annotations

import json
import math

import pytest

from portarl.bench.hardware import check, plan as plan_lib
from portarl.bench.hardware.tests_stage import read_junit
from portarl.bench.hardware.summary import summary_markdown
from portarl.bench.hardware.training_stage import summarise
from portarl.cli import main


def test_usage_errors_exit_2_naming_the_argument(tmp_path, capsys):
    assert main(["hardware-check", "--device", "tpu", "--out", str(tmp_path / "a")]) == 2
    assert "--device 'tpu': choose cuda, npu or cpu" in capsys.readouterr().err
    assert main(["hardware-check", "--device", "cpu", "--out", str(tmp_path / "a"), "--stages", "bogus"]) == 2
    assert "--stages bogus: choose from environment" in capsys.readouterr().err
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    assert main(["hardware-check", "--device", "cpu", "--out", str(full)]) == 2
    err = capsys.readouterr().err
    assert "holds other files (notes.txt)" in err and (full / "notes.txt").read_text() == "mine"


def test_plans_fit_the_lent_machine():
    gpu = plan_lib.make_plan("cuda")
    assert not gpu.quick and gpu.parity_large and gpu.total_s <= 8 * 60
    assert set(gpu.limits_s) == set(plan_lib.STAGES)
    assert (4096, 151936) in gpu.kernel_shapes and (8192, 128256) in gpu.kernel_shapes
    assert {"bf16", "fp32"} <= set(gpu.kernel_dtypes) and {"bf16", "fp32"} <= set(gpu.linear_dtypes)
    cpu = plan_lib.make_plan("cpu")  # the CPU always runs the small shapes
    assert cpu.quick and not cpu.parity_large
    assert len(check.OUTPUT_FILES) <= check.MAX_FILES


def test_a_stage_whose_device_is_absent_fails_named_and_the_check_exits_1(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    out = tmp_path / "out"
    p = plan_lib.make_plan("cuda")
    code = check.run_check(p, out, stages=("environment",), work=tmp_path / "work", say=lambda line: None)
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("portarl hardware-check: environment failed:") and "cuda" in err[0]
    outcome = json.loads((out / "check.json").read_text())["stages"]["environment"]
    assert outcome["status"] == "failed"
    assert "FAILED (environment)" in (out / "summary.md").read_text()
    assert "Traceback" in (out / "check.log").read_text()  # the traceback went to the log, not the terminal


def test_a_stage_past_its_limit_is_stopped_and_named(tmp_path):
    p = plan_lib.make_plan("cpu", quick=True)
    p.limits_s["environment"] = 0.05  # less than importing torch takes: the child is still starting
    out = tmp_path / "out"
    code = check.run_check(p, out, stages=("environment",), work=tmp_path / "work", say=lambda line: None)
    assert code == 1
    outcome = json.loads((out / "check.json").read_text())["stages"]["environment"]
    assert outcome["status"] == "failed" and "ran past its 0 s limit and was stopped" in outcome["line"]


def test_the_budget_spent_leaves_later_stages_named_not_skipped(tmp_path):
    p = plan_lib.make_plan("cpu", quick=True, total_s=1.0)
    out = tmp_path / "out"
    assert check.run_check(p, out, stages=("environment", "parity"), work=tmp_path / "w", say=lambda line: None) == 1
    stages = json.loads((out / "check.json").read_text())["stages"]
    assert list(stages) == ["environment", "parity"]
    assert stages["parity"]["status"] == "failed" and "were spent" in stages["parity"]["line"]


def test_junit_reader_counts_and_keeps_skip_reasons(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites><testsuite>
<testcase classname="tests.a" name="t1"/>
<testcase classname="tests.a" name="t2"><skipped message="needs flash-attn"/></testcase>
<testcase classname="tests.a" name="t3"><skipped message="needs flash-attn"/></testcase>
<testcase classname="tests.b" name="t4"><failure message="AssertionError: 3 != 4">trace</failure></testcase>
<testcase classname="tests.b" name="t5"><error message="fixture broke"/></testcase>
</testsuite></testsuites>""")
    counts, skipped, failures = read_junit(xml)
    assert counts == {"passed": 1, "failed": 2, "skipped": 2}
    assert skipped == {"needs flash-attn": 2}
    assert failures[0] == "tests.b::t4: AssertionError: 3 != 4" and failures[1].startswith("tests.b::t5")
    assert read_junit(tmp_path / "missing.xml")[0] == {"passed": 0, "failed": 0, "skipped": 0}


def _metrics(run_dir, losses):
    run_dir.mkdir(parents=True)
    rows = [{"step": i + 1, "phase": "grpo", "loss": v, "reward/mean": 0.1 * i, "grad_norm": 1.0,
             "guard/skipped_total": 0, "time/step_s": 0.5} for i, v in enumerate(losses)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_short_run_that_went_non_finite_or_stopped_early_is_a_problem(tmp_path):
    _metrics(tmp_path / "ok", [0.1, 0.2, 0.3, 0.4, 0.5])
    good = summarise("cuda:bf16", tmp_path / "ok", 5)
    assert good["problem"] is None and good["steps_done"] == 5
    assert math.isclose(good["reward_first"], 0.0) and math.isclose(good["reward_last"], 0.4)
    _metrics(tmp_path / "nan", [0.1, float("nan"), 0.3])
    assert summarise("cuda:fp16", tmp_path / "nan", 3)["problem"] == "non-finite loss at step 2 (1 steps)"
    _metrics(tmp_path / "short", [0.1, 0.2])
    (tmp_path / "short" / "run.json").write_text(json.dumps({"stopped": "guards: 3 consecutive skipped steps"}))
    assert summarise("x", tmp_path / "short", 30)["problem"] == \
        "stopped at step 2 of 30: guards: 3 consecutive skipped steps"
    (tmp_path / "dead").mkdir()
    (tmp_path / "dead" / "run.json").write_text(json.dumps({"crashed": "process killed by SIGKILL (out of memory?)"}))
    assert summarise("x", tmp_path / "dead", 30)["problem"].startswith("crashed: process killed by SIGKILL")


def test_summary_names_every_stage_and_the_failed_ones(tmp_path):
    p = plan_lib.make_plan("cuda")
    outcomes = {"environment": {"status": "ok", "line": "H100", "seconds": 3.0},
                "parity": {"status": "failed", "line": "2 of 900 parity checks out of tolerance", "seconds": 80.0,
                           "failed": ["cuda bf16 logprobs hw_n4096 grad: worst error 1.50x the tolerance"]},
                "step": {"status": "ok", "line": "qwen2.5-0.5b: step 7.00 s vs plain 9.00 s (1.29x)", "seconds": 60.0,
                         "command": "portarl bench step --device cuda --shapes qwen2.5-0.5b",
                         "settings": {"prompts": 4, "group": 4, "new_tokens": 512},
                         "shapes": [{"shape": "qwen2.5-0.5b", "rollout_s": 6.0, "scoring_s": 0.01, "step_speedup": 1.29,
                                     "update_speedup": 3.0,
                                     "portarl": {"step_s": 7.0, "update_s": 1.0, "update_peak_mib": 5000.0,
                                                 "tokens_per_s": 1170.0},
                                     "plain": {"step_s": 9.0, "update_s": 3.0, "update_peak_mib": 31000.0,
                                               "tokens_per_s": 910.0}}]},
                "hardware-tests": {"status": "ok", "line": "280 passed", "seconds": 50.0,
                                   "skipped": {"needs flash-attn": 3}}}
    text = summary_markdown(p, tmp_path, outcomes, 133.0)
    assert "| qwen2.5-0.5b | 6.00 | 1.00 | 3.00 | 1.29x | 1170 / 910 | 5000 / 31000 |" in text
    assert "**FAILED (parity)**" in text
    for name in outcomes:
        assert f"| {name} |" in text
    assert "worst error 1.50x" in text and "skipped 3: needs flash-attn" in text


def test_a_stopped_test_run_is_counted_from_its_verbose_output():
    """The hardware tests are stopped inside the stage's limit before pytest writes its JUnit
    file: what ran is read from ``pytest -v`` lines (xdist's and plain), each test once."""
    from portarl.bench.hardware.tests_stage import read_verbose

    text = """[gw0] [  1%] PASSED tests/parity/test_a.py::test_x[cuda-gpu-bf16]
[gw1] [  2%] FAILED tests/parity/test_b.py::test_y[cuda-gpu]
tests/test_c.py::test_z[cuda-gpu] SKIPPED (needs flash-attn) [ 3%]
tests/test_c.py::test_w[cuda-gpu] PASSED                                  [ 4%]
FAILED tests/parity/test_b.py::test_y[cuda-gpu] - AssertionError
"""
    counts, _, failures = read_verbose(text)
    assert counts == {"passed": 2, "failed": 1, "skipped": 1}
    assert failures == ["tests/parity/test_b.py::test_y[cuda-gpu]"]


def test_hardware_cases_draw_their_inputs_once_and_never_hand_out_the_kept_draws():
    """The hardware-sized parity cases are drawn once for every backend and dtype (on a GPU
    the host's drawing took most of each case's time); the tensors handed out are copies, so a
    backend writing into its input cannot change the next one's."""
    import torch

    from portarl.parity import cases

    case = cases.LogprobsCase("big_sliced", lead=(2, 4096), vocab=2049, layout="sliced", seed=5)
    a, la = case.make(torch.float32)
    first = a.clone()
    kept = cases._LAST_DRAWS["draws"][0]
    a.add_(1.0)
    b, lb = case.make(torch.float32)
    assert cases._LAST_DRAWS["draws"][0] is kept
    assert torch.equal(first, b) and torch.equal(la, lb)
    c, _ = case.make(torch.bfloat16)
    assert torch.equal(c, b.to(torch.bfloat16))


def test_sigterm_stops_the_check_and_its_running_stage(tmp_path):
    """The stage runs in a session of its own (so that a hung one can be killed with its
    children); a SIGTERM to the check must take it along, not leave it running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PORTARL_SUPERVISE="0")
    proc = subprocess.Popen([sys.executable, "-m", "portarl", "hardware-check", "--device", "cpu", "--quick",
                             "--stages", "parity", "--out", str(out), "--work", str(tmp_path / "work")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        log = out / "check.log"
        while proc.poll() is None and not (log.exists() and "[  1/" in log.read_text(errors="replace")):
            time.sleep(0.2)  # until the stage's own process is at work (its first case logged)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in err
    stage_left = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if "portarl.bench.hardware.stage" in cmd and str(tmp_path) in cmd:
                stage_left.append(pid)
    assert not stage_left, f"stage processes left running: {stage_left}"


def test_the_summary_names_the_code_that_ran_by_content(tmp_path):
    """A lent machine's copied tree may carry a stale .git: the package files' digest says
    what ran, and changes with any file's content or name."""
    from portarl.bench.hardware.environment import tree_digest

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    first = tree_digest(tmp_path)
    assert tree_digest(tmp_path) == first and len(first) == 12
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert tree_digest(tmp_path) != first
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "b.py")
    assert tree_digest(tmp_path) != first
    p = plan_lib.make_plan("cuda")
    (tmp_path / "envinfo.json").write_text(json.dumps({"portarl_tree_sha256": first, "device_name": "X"}))
    assert f"package files sha256 {first}" in summary_markdown(p, tmp_path, {}, 1.0)
