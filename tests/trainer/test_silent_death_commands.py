"""``portarl eval`` and ``portarl sft`` die the same way ``train`` does (issue 44): a reward
that calls ``os._exit(0)`` during ``portarl eval``, and the OOM killer's SIGKILL during
``portarl sft``, end the command non-zero with one line naming what was running and the
command to run again (before, eval exited 0 without a word and sft died with -9)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from portarl.trainer import GRPOTrainer, build_from_config
from proc_tree import line_queue, supervised
from trainer_fast import FAST, fast_config

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="os.fork, /proc")


def _env(**extra: str) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **extra}
    env.pop("TRITON_INTERPRET", None)
    return env


def test_eval_with_a_reward_that_calls_os_exit_0_exits_non_zero_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DIE_AFTER", str(10**9))  # the run that makes the checkpoint: the reward never dies
    cfg = fast_config(tmp_path, "train.steps=1", "rewards=[{name: 'dying_code:reward'}]")
    model, tokenizer, examples = build_from_config(cfg)
    GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu").train()
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(3)))
    command = ["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(data), "--device", "cpu"]
    run = subprocess.run([sys.executable, "-m", "portarl", *command], env=_env(DIE="exit0", DIE_AFTER="0"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 5, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "portarl eval: the run died (eval), while reward 'dying_code:reward' on sample 0 (prompt '0+1=') was "
        "running: the process exited with code 0 without finishing (os._exit or exit() in user or native code); "
        f"nothing was saved; run it again with: portarl {' '.join(command)}")


def test_sft_killed_by_the_oom_killer_says_so(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "portarl", "sft", "--device", "cpu", "--output-dir", str(out), "--steps", "100000"]
    for item in FAST:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, reader = line_queue(proc.stderr)
    seen = []
    try:
        while not any(line.startswith("sft step 10/") for line in seen):  # mid-run (one line per 10 steps)
            seen.append(lines.get(timeout=600))
        os.kill(supervised(proc.pid), signal.SIGKILL)  # what the OOM killer does to the process holding the memory
        proc.wait(timeout=600)
    finally:
        proc.kill()
        proc.wait()
        reader.join()
    while not lines.empty():
        seen.append(lines.get())
    assert proc.returncode == 128 + signal.SIGKILL, "".join(seen)[-3000:]
    line = seen[-1].strip()
    assert line.startswith("portarl sft: the run died in step ") and " (sft): the process was killed by SIGKILL (the " \
        "out-of-memory killer, or kill -9); nothing was saved; run it again with: portarl sft --device cpu" in line, line
    assert not (out / "sft-model").exists()
