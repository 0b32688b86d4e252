"""``rollout.mode=async`` with the vllm engine (issue 25): vLLM runs in the rollout worker's
process, fed the trainer's published weights through its in-place reload.

What is checked: the CLI trains with staleness, wait and mismatch metrics and advancing
weight versions, and no group's samples are identical (per-sample seeds); at staleness 0
every batch's behaviour log-probs are those of the weights the trainer published for it
(within ``ROLLOUT_FP32_ATOL``, the vLLM-vs-trainer bound of the other vLLM tests) and not
those of the first version, so the weights really travel; and the run reproduces colocated
vLLM bitwise on the CPU.

Time: no fixed deadline here. The subprocess limit only bounds a run that has already
hung; the trainer's own ``rollout.timeout_s`` keeps its default (600 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from proc_tree import children
from vllm_tiny import NO_VLLM, TRAIN_SETS

pytest.importorskip("vllm.entrypoints.llm", reason=NO_VLLM)

from portarl.parity.tolerances import ROLLOUT_FP32_ATOL  # noqa: E402
from portarl.trainer.async_pipeline import WORKER_LOG, AsyncRollout  # noqa: E402
from portarl.trainer.sequences import build_batch, completion_logprobs  # noqa: E402

STEPS = 3
# A learning rate large enough that one optimizer step moves the tiny model's log-probs
# well past ROLLOUT_FP32_ATOL: a worker that kept old weights cannot pass for a current one.
SETS = [*TRAIN_SETS, f"train.steps={STEPS}", "optim.lr=1e-2", "logging.progress=false",
        "logging.tensorboard=false", "logging.plot=false"]
ASYNC_KEYS = ("rollout/staleness_mean", "rollout/staleness_max", "rollout/version", "rollout/wait_s", "train/wait_s",
              "rollout/gen_s", "rollout/score_s", "rollout/publish_s")
MISMATCH = ("mismatch/abs_diff_mean", "mismatch/abs_diff_max", "mismatch/kl_k3", "mismatch/masked_frac")


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train(out, *extra: str):
    from portarl.trainer import GRPOTrainer, TrainConfig, build_from_config

    cfg = TrainConfig.load(None, [*SETS, f"output_dir={out}", *extra])
    model, tok, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tok, None, examples, cfg, device="cpu")
    try:
        trainer.train()
    finally:
        trainer.close()  # colocated: the in-process vLLM engine
    return trainer


@pytest.fixture(scope="module")
def async_s0(tmp_path_factory):
    """An async vllm run at max_staleness 0, with the weights of every published version and
    every batch the trainer received captured on the trainer's side."""
    out = tmp_path_factory.mktemp("async0")
    weights, batches = {}, []
    publish, batch = AsyncRollout._publish, AsyncRollout.batch

    def capture_publish(self):
        version = self.trainer.step
        weights.setdefault(version, {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()})
        return publish(self)

    def capture_batch(self, step):
        result = batch(self, step)
        batches.append((step, int(result[5]["rollout/version"]), result[1]))
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AsyncRollout, "_publish", capture_publish)
        mp.setattr(AsyncRollout, "batch", capture_batch)
        trainer = _train(out, "rollout.mode=async", "rollout.engine=vllm", "rollout.max_staleness=0")
    assert not children(os.getpid()), "the rollout worker outlived the run"
    return out, trainer, weights, batches


def test_async_vllm_trains_from_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "portarl", "train", "--device", "cpu", "--output-dir", str(tmp_path),
           *[arg for item in (*SETS, "rollout.mode=async", "rollout.engine=vllm") for arg in ("--set", item)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert all(key in r for key in (*ASYNC_KEYS, *MISMATCH)), sorted(r)
        assert r["rollout/identical_group_frac"] == 0, f"step {r['step']}: identical groups"
    # max_staleness 1 (the default): the first batch waits for version 0, the next ones overlap
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    assert [r["rollout/version"] for r in rows] == [0, 0, 1]
    assert "starting vLLM" in (tmp_path / WORKER_LOG).read_text()  # the worker ran the vllm engine
    batches = _jsonl(tmp_path / "rollout_batches.jsonl")
    assert [(b["step"], b["version"]) for b in batches] == [(1, 0), (2, 0), (3, 1)]


def test_behaviour_logprobs_are_those_of_the_published_weights(async_s0):
    out, trainer, weights, batches = async_s0
    assert "starting vLLM" in (out / WORKER_LOG).read_text()
    assert [(s, v) for s, v, _ in batches] == [(s, s - 1) for s in range(1, STEPS + 1)]
    model = trainer.model
    temperature = trainer.config.rollout.temperature
    g = trainer.config.rollout.group_size

    def max_diff(version, rollout):
        model.load_state_dict(weights[version])
        b = build_batch(rollout.prompt_ids, rollout.completion_ids, trainer.codec.pad_token_id, "cpu")
        with torch.no_grad():
            ours = completion_logprobs(model, b, temperature=temperature)
        theirs = torch.zeros_like(ours)
        for i, lps in enumerate(rollout.logprobs):
            theirs[i, : len(lps)] = torch.tensor(lps)
        return (ours - theirs).abs()[b.mask].max().item()

    for step, version, rollout in batches:
        groups = [rollout.completion_ids[i : i + g] for i in range(0, len(rollout.completion_ids), g)]
        assert all(len({tuple(c) for c in group}) > 1 for group in groups), f"step {step}: a group of identical samples"
        assert max_diff(version, rollout) < ROLLOUT_FP32_ATOL, f"step {step}: not the weights of version {version}"
        if version > 0:  # the check can fail: the first weights give log-probs measurably off
            assert max_diff(0, rollout) > ROLLOUT_FP32_ATOL, f"step {step}: version 0 indistinguishable"
    rows = _jsonl(out / "metrics.jsonl")
    assert all(r["mismatch/abs_diff_max"] < ROLLOUT_FP32_ATOL and r["rollout/staleness_max"] == 0 for r in rows)


def test_staleness_0_reproduces_colocated_vllm_bitwise(async_s0, tmp_path):
    out = async_s0[0]
    _train(tmp_path)
    ref, got = _jsonl(tmp_path / "metrics.jsonl"), _jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in ref] == [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        differ = {k: (v, b.get(k)) for k, v in a.items() if not k.startswith("time/") and b.get(k) != v}
        assert not differ, f"step {a['step']}: {differ}"
