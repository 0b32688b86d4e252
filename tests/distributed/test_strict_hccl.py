"""Two ranks in the process group ``portarl.runtime.distributed.init_distributed`` makes for Ascend
NPUs, over a stand-in ``hccl`` registered for the ``npu`` device type only, as torch_npu
registers it (tests/distributed/hccl_standin.py). Every collective the trainer makes runs
there: the flags and codes of the step guard and the stop agreement, the step guard's KL
sync, the micro-batch count, the reward gather, the metrics, the checkpoint's barriers and
(on ``--resume``) the agreement on which checkpoint to load, and in async mode the
pipeline's JSON. A host-side value sent to a backend that refuses CPU tensors fails here
the way it fails on the first ``torchrun ... portarl train --device npu``.

NOT hardware: Gloo runs underneath, and the tensors are CPU tensors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from portarl.trainer.checkpoint import CheckpointManager  # noqa: E402
from portarl.runtime.distributed import local_launcher
from test_fsdp_gloo import FAST, _env, _rows  # noqa: E402

HERE = Path(__file__).parent
WORKER = HERE / "strict_hccl_worker.py"

pytestmark = pytest.mark.npu_standin


def _strict_train(out: Path, *sets: str, resume: bool = False) -> subprocess.CompletedProcess:
    cmd = [*local_launcher(2), str(WORKER), "train",
           "--device", "cpu", "--output-dir", str(out)]
    for item in (*FAST, *sets):
        cmd += ["--set", item]
    if resume:
        cmd.append("--resume")
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)


def test_train_and_resume_in_the_npu_process_group(tmp_path):
    proc = _strict_train(tmp_path, "train.steps=1", "loss.kl_coef=0.05", "train.max_tokens_per_micro_batch=64")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "process group backend 'cpu:gloo,npu:hccl'" in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count("host collectives ok") == 2, proc.stderr[-4000:]
    proc = _strict_train(tmp_path, "train.steps=2", "loss.kl_coef=0.05", "train.max_tokens_per_micro_batch=64",
                         resume=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
    latest = CheckpointManager(tmp_path).latest()
    assert CheckpointManager.is_sharded(latest) and CheckpointManager.load_state(latest)["step"] == 2


def test_async_pipeline_in_the_npu_process_group(tmp_path):
    proc = _strict_train(tmp_path, "train.steps=2", "rollout.mode=async")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
