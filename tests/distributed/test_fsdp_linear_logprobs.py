"""The trainer's fused scoring path (``completion_logprobs`` -> ``ops.linear_logprobs``) under
FSDP2 on 2 Gloo ranks against 1 unsharded process, tied and untied output embeddings.

Both runs are tests/distributed/fsdp_linear_worker.py on the same 4 sequences: one plain
process, and 2 torchrun ranks with 2 sequences each through a ``fully_shard``-ed tiny Qwen2
(the head passed through, its all-gathered weight handed to the op). Per-token log-probs,
entropy, the op's gradient w.r.t. its hidden states and the ``full_tensor`` of the output
embedding's gradient (FSDP's reduce-scatter) must agree within the fp32 tolerances of
:mod:`portarl.parity.tolerances`. The float64 result of the same inputs checks that the
single process itself is right, so the comparison cannot pass on two equally wrong runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

import run_guard  # noqa: E402
from portarl.parity.errors import assert_close  # noqa: E402
from portarl.parity.float64 import linear_logprobs_float64  # noqa: E402
from portarl.parity.tolerances import contracted_gradient, fp32_result  # noqa: E402

HERE = Path(__file__).parent
WORKER = HERE / "fsdp_linear_worker.py"
sys.path.insert(0, str(HERE))
import fsdp_linear_worker as worker  # noqa: E402
from portarl.runtime.distributed import local_launcher


def _env():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_linear")
    single, double = root / "single", root / "double"
    single.mkdir()
    double.mkdir()
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(single)], env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True),
        subprocess.Popen([*local_launcher(2), str(WORKER),
                          str(double)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    ]
    for proc in procs:
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-4000:]
    return single, double


def _labels():
    from portarl.trainer.phases.sequences import build_batch

    return build_batch(worker.PROMPTS, worker.COMPLETIONS, pad_id=0, device="cpu").labels


@pytest.mark.compares_runs
@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_two_gloo_ranks_match_one_process(runs, tie):
    one = safetensors.load_file(str(runs[0] / f"{tie}.safetensors"))
    two = safetensors.load_file(str(runs[1] / f"{tie}.safetensors"))
    for name, run in (("1 process", one), ("2 ranks", two)):  # the gradients compared flow (the guard)
        run_guard.assert_gradient_flows({k: run[k] for k in ("grad_hidden", "grad_weight")},
                                        what=f"{tie}: the op's gradients on {name}")
    labels = _labels()
    valid = labels != -100
    assert valid.sum() > 8 and (~valid).any(), "the batch must hold scored and padded positions"

    hidden, weight = one["hidden"], one["weight"]
    assert weight.shape == (worker.VOCAB, hidden.shape[-1])
    torch.testing.assert_close(two["weight"], weight, rtol=0, atol=0)  # the gathered head == the full one
    scale = (hidden.double() @ weight.double().T).abs().max().item() / worker.TEMPERATURE
    tol = fp32_result(scale)
    for key in ("logp", "entropy"):
        assert_close(two[key], one[key], tol, f"{tie} {key}: 2 ranks vs 1 process")
    assert (one["entropy"][valid] > 0.02).all(), "a degenerate softmax would test nothing"

    # Gradients: fp32 sums of products; `mass` bounds their sum of |terms| (parity.tolerances).
    gen = torch.Generator().manual_seed(1)
    g_logp = torch.randn(labels.shape, generator=gen)
    g_ent = torch.randn(labels.shape, generator=gen)
    ref = linear_logprobs_float64(hidden, weight, labels, temperature=worker.TEMPERATURE,
                                  grad_logp=g_logp, grad_entropy=g_ent)
    # As tests/parity/test_linear_logprobs.py: |d logits| of float64 summed over the contraction.
    gz = ref["grad_logits"].abs().reshape(-1, worker.VOCAB)
    mass_h = float(gz.sum(-1).max()) * float(weight.double().abs().max())
    mass_w = float(gz.sum(0).max()) * float(hidden.double().abs().max())
    assert_close(two["grad_hidden"], one["grad_hidden"], contracted_gradient(scale, mass_h, torch.float32),
                 f"{tie} d/d hidden: 2 ranks vs 1 process")
    assert_close(two["grad_weight"], one["grad_weight"], contracted_gradient(scale, mass_w, torch.float32),
                 f"{tie} d/d lm-head weight (full_tensor of the DTensor grad): 2 ranks vs 1 process")

    # The single process is itself right: the op's outputs and its hidden gradient vs float64.
    assert_close(one["logp"], ref["logp"].view(labels.shape), tol, f"{tie} logp vs float64")
    assert_close(one["entropy"], ref["entropy"].view(labels.shape), tol, f"{tie} entropy vs float64")
    assert_close(one["grad_hidden"], ref["grad_hidden"], contracted_gradient(scale, mass_h, torch.float32),
                 f"{tie} d/d hidden vs float64")
    if tie == "untied":  # the head's gradient is the op's alone (tied: plus the embedding's)
        assert_close(one["grad_weight"], ref["grad_weight"], contracted_gradient(scale, mass_w, torch.float32),
                     f"{tie} d/d weight vs float64")
    else:
        assert not torch.allclose(one["grad_weight"], ref["grad_weight"].float(), atol=1e-3), \
            "tied: the embedding's own gradient must be in the shared weight's gradient"
