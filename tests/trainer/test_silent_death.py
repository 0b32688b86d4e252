"""No silent death from user code (issue 44): a reward, a tool or an environment that ends
its process with ``os._exit(0)``, ``os._exit(7)`` or a segfault, in colocated mode and in
async mode (the rollout worker), ends ``portarl train`` non-zero with one line naming the
function, the step and what to run next. Before, ``os._exit(0)`` ended a run with exit 0
and no word, a segfault with 139 and nothing naming it, and async mode said only "the
rollout worker exited".

The 18 runs (make test: 9 of them, every pair of death, place and mode; tests/suite_budget.py)
are short CLI subprocesses (1-2 steps of a tiny model, the death at the first
call or after step 1's checkpoint), two at a time; the tests check their outcomes."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trainer_fast import FAST

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="os.fork, /proc")

DEATHS = ("exit0", "exit7", "segv")
WHERE = ("reward", "tool", "environment")
MODES = ("colocated", "async")
CASES = list(itertools.product(DEATHS, WHERE, MODES))
#: The call of the user function named in the line, per place.
NAMED = {"reward": "reward 'dying_code:reward' on sample 0", "tool": "tool 'leave_now'",
         "environment": "environment 'DyingEnv' reset()"}
#: What a reward run needs on top of FAST (16 reward calls per step: group 4 x 4 prompts).
CALLS_PER_STEP = 16


def tool_caller_files(directory: Path) -> tuple[Path, Path]:
    """``(model directory, data file)``: a tiny Qwen2 whose every assistant turn is one tool
    call of ``leave_now`` (a token of its own), then ``<|im_end|>``. Its layers add nothing
    (output projections zero), so it is a bigram model: after the generation prompt's
    newline the call, after the call the end of the turn, both at a margin of ~50 logits."""
    import torch

    from agent_tiny import agent_tokenizer, tiny_model

    tok = agent_tokenizer()
    call = '<tool_call>{"name": "leave_now", "arguments": {}}</tool_call>'
    tok.add_tokens([call])
    model = tiny_model(len(tok))
    model.config.tie_word_embeddings = False
    d = model.config.hidden_size
    newline, calls, end = tok.convert_tokens_to_ids(["\n", call, "<|im_end|>"])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb[newline] = torch.nn.functional.one_hot(torch.tensor(0), d).float()
        emb[calls] = torch.nn.functional.one_hot(torch.tensor(1), d).float()
        head = torch.zeros(len(tok), d)
        head[calls, 0] = head[end, 1] = 10.0  # x sqrt(d) after the final RMSNorm
        model.lm_head = torch.nn.Linear(d, len(tok), bias=False)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(directory / "model")
    tok.save_pretrained(directory / "model")
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Count {i}"}]}) + "\n"
                            for i in range(8)))
    return directory / "model", data


def _command(out: Path, death: str, where: str, mode: str, agent_files) -> tuple[list[str], dict]:
    sets = [*FAST, "train.steps=2", "checkpoint.every=1", "rollout.max_turns=3"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DIE": death,
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    if mode == "async":
        sets.append("rollout.mode=async")
    if where == "reward":
        sets.append("rewards=[{name: 'dying_code:reward'}]")
        if death == "exit7":  # after step 1 and its checkpoint
            env["DIE_AFTER"] = str(CALLS_PER_STEP)
    else:
        model, data = agent_files
        sets += [f"model.path={model}", f"data.path={data}", "rewards=[{name: 'dying_code:batched_zero'}]",
                 "rollout.max_new_tokens=4"]
        sets.append("tools=['dying_code:leave_now']" if where == "tool" else "environment=dying_code:DyingEnv")
    cmd = [sys.executable, "-m", "portarl", "train", "--device", "cpu", "--output-dir", str(out)]
    for item in sets:
        cmd += ["--set", item]
    return cmd, env


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """Every running case's ``(exit code, stderr, output directory)``, two runs at a time
    (make test runs 9 of the 18: tests/suite_budget.py)."""
    from suite_budget import running_params

    cases = sorted(running_params(request, "test_user_code_that_ends_the_process_is_named_and_the_run_exits_non_zero",
                                  ("death", "where", "mode")))
    root = tmp_path_factory.mktemp("silent-death")
    agent_files = tool_caller_files(root)

    def run(case):
        out = root / "-".join(case)
        cmd, env = _command(out, *case, agent_files)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        return case, (proc.returncode, proc.stderr, out)

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(run, cases))


def _last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("death, where, mode", CASES, ids=["-".join(c) for c in CASES])
def test_user_code_that_ends_the_process_is_named_and_the_run_exits_non_zero(outcomes, death, where, mode):
    code, stderr, out = outcomes[(death, where, mode)]
    line = _last_line(stderr)
    after_checkpoint = where == "reward" and death == "exit7"
    step = 2 if after_checkpoint else 1
    assert code != 0, stderr[-3000:]
    assert NAMED[where] in line, stderr[-3000:]
    if mode == "colocated":  # the supervising parent's line
        assert code == {"exit0": 5, "exit7": 5, "segv": 139}[death], stderr[-3000:]
        assert line.startswith(f"portarl train: the run died in step {step} ("), line
        how = "killed by SIGSEGV (a crash in native code" if death == "segv" else \
            f"exited with code {death[4:]} without finishing"
        assert how in line, line
        if after_checkpoint:
            assert f"the newest checkpoint is {out / 'checkpoints' / 'step-000001'}; continue with: portarl train" in line
            assert line.endswith("--resume"), line
        else:
            assert "there is no checkpoint yet; start again with: portarl train" in line and "--resume" not in line
        if death == "segv":  # faulthandler's frames, in the run's directory
            crash = (out / "crash.log").read_text()
            assert f"its Python frames are in {out / 'crash.log'}" in line
            assert "Segmentation fault" in crash and "dying_code.py" in crash
    else:  # the trainer names the worker's death from the worker's record, then stops as for any worker fault
        assert code == 3, stderr[-3000:]
        how = "was killed by SIGSEGV" if death == "segv" else f"exited with code {death[4:]}"
        assert line.startswith(f"portarl train: stopping at step {step}: the rollout worker"), line
        assert how in line and f"in step {step} (" in line, line
        assert "Checkpoint of step" in line, line
    assert "Traceback" not in stderr, stderr[-3000:]
