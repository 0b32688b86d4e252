"""The weights a colocated vllm engine receives under torchrun (issue 36): every rank gathers
the FSDP2 shards of a LoRA model, the adapter folded in, a bucket at a time
(:func:`portarl.rollout.vllm_weights.gathered_weights`), and gets what one process hands
its engine (:func:`~portarl.rollout.vllm_weights.local_weights`): the same names (no tied
head), the same values. The engine itself under torchrun is tested in
tests/vllm_engine/test_vllm_torchrun.py (`make test-vllm`; its environment has no peft)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from portarl.runtime.distributed import local_launcher

pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from test_fsdp_gloo import _env  # noqa: E402

WORKER = Path(__file__).parent / "vllm_gather_worker.py"


@pytest.fixture(scope="module")
def received(tmp_path_factory):
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    for cmd in ([sys.executable, str(WORKER), str(one)],
                [*local_launcher(2), str(WORKER), str(two)]):
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return one, two


@pytest.mark.parametrize("tied", ["tied", "untied"])
def test_every_rank_receives_the_merged_unsharded_weights(received, tied):
    one, two = received
    expected = load_file(one / f"{tied}-rank0.safetensors")
    assert ("lm_head.weight" in expected) == (tied == "untied")  # vLLM ties the head itself
    assert not any("lora_" in k or "base_layer" in k for k in expected)
    for rank in (0, 1):
        got = load_file(two / f"{tied}-rank{rank}.safetensors")
        assert list(got) == list(expected)  # the state dict's order, on every rank
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
