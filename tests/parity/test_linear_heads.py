"""The cuda backend's three linear log-prob heads (portarl.backends.cuda.linear_heads):
``split`` (split-vocabulary Triton), ``cublas`` (fixed-shape GEMM chunks + Triton rows) and
``tile`` (the chunked Triton tile), each against float64 and through the invariance gate;
and the choice between them.

On the CPU the Triton kernels run under the interpreter and the ``cublas`` head's GEMMs are
``torch.mm`` on the same fixed-shape chunks (the head's own padding, pieces and row
kernels); on a GPU (``cuda-gpu``) the same tests run the compiled kernels and cuBLAS.

The invariance gate (issue 59): a row's fp32 log-prob, entropy and gradient with respect to
its hidden state are the same bits computed alone and inside batches of 1, 2, 17, 128, 4095,
4096 and 8192 rows, at its first, middle and last position (the probe is planted at all
three in one batch), and from one run to the next. ``make test`` gates batches up to 128 on
the interpreter; the 4095-8192-row batches run in ``make test-full`` and on the GPU
(tests/suite_budget.py).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from portarl import ops
from portarl.backends.cuda import linear_heads
from test_linear_logprobs import CASES, DTYPES, NAMES, _check_case

HEADS = ["split", "cublas"]  # ``tile`` is what test_linear_logprobs.py runs under the interpreter
#: The float64 cases the interpreter runs for each head: a bias and a temperature, strided
#: rows, every row ignored, and the big (tensor-core) tile; every case runs on hardware.
_SMALL = {"v17_h8_bias_t07", "v17_h64_strided", "v4099_h8_all_ignored", "v2048_h64_aligned_bias"}
HEAD_CASES = [pytest.param(c, id=c.name) if c.name in _SMALL else
              pytest.param(c, id=c.name, marks=pytest.mark.gpu) for c in CASES]
GATE_BATCHES = [1, 2, 17, 128, 4095, 4096, 8192]


@pytest.fixture
def head(request, monkeypatch):
    monkeypatch.setenv(linear_heads.HEAD_ENV, request.param)
    return request.param


@pytest.mark.parametrize("head", HEADS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: NAMES[d])
@pytest.mark.parametrize("case", HEAD_CASES)
def test_each_head_matches_float64(triton_target, head, case, dtype):
    _check_case(triton_target, case, dtype)


@pytest.mark.parametrize("head", HEADS, indirect=True)
def test_each_head_in_small_chunks(triton_target, head, monkeypatch):
    """Many chunks (the split head's partials and the cublas head's fixed chunks, the last one
    padded) still match float64."""
    from test_linear_logprobs import Case

    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", "512")
    _check_case(triton_target, Case("chunked", (4, 6), 301, 24, bias=True, seed=9), torch.float32)
    _check_case(triton_target, Case("chunked_aligned", (3, 5), 320, 48, seed=10), torch.bfloat16)


def _gate_run(device, hidden, weight, labels, probe_rows):
    """(logp, entropy, grad of the hidden states) at ``probe_rows``, fp32, on the CPU."""
    h = hidden.to(device).detach().requires_grad_(True)
    logp, ent = ops.linear_logprobs(h, weight, labels.to(device), return_entropy=True, backend="cuda")
    gl, ge = torch.zeros(labels.shape), torch.zeros(labels.shape)
    gl[probe_rows], ge[probe_rows] = 0.7, -0.3
    torch.autograd.backward((logp, ent), (gl.to(device), ge.to(device)))
    return logp.detach()[probe_rows].cpu(), ent.detach()[probe_rows].cpu(), h.grad[probe_rows].float().cpu()


def gate(device, dtype, vocab, width, batches, seed=5):
    """Run the invariance gate; returns the batches checked."""
    gen = torch.Generator().manual_seed(seed)
    weight = (0.5 * torch.randn(vocab, width, generator=gen)).to(dtype).to(device)
    probe = torch.randn(1, width, generator=gen).to(dtype)
    probe_label = torch.tensor([vocab // 3])
    alone = _gate_run(device, probe, weight, probe_label, [0])
    again = _gate_run(device, probe, weight, probe_label, [0])
    for what, a, b in zip(("logp", "entropy", "grad"), alone, again):
        assert torch.equal(a, b), f"{what} of a row changed from one run to the next"
    for batch in batches:
        rows = sorted({0, batch // 2, batch - 1})
        others = torch.randn(batch, width, generator=gen).to(dtype)
        labels = torch.randint(0, vocab, (batch,), generator=gen)
        others[rows], labels[rows] = probe[0], probe_label[0]
        inside = _gate_run(device, others, weight, labels, rows)
        for what, a, b in zip(("logp", "entropy", "grad"), alone, inside):
            for i, row in enumerate(rows):
                assert torch.equal(a[0], b[i]), f"{what} of a row differs alone vs at row {row} of a batch of {batch}"
    return batches


# (40, 24): the small tile; (64, 32): H and V multiples of 16, the big (tensor-core) tile.
@pytest.mark.parametrize("shape", [(40, 24), (64, 32)], ids=["small-tile", "big-tile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head", ["split", "cublas", "tile"], indirect=True)
def test_invariance_gate(triton_target, head, dtype, shape, monkeypatch):
    """Batches of 1 to 128 rows, every head, dtype and tile."""
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", str(1 << 12))  # several chunks at 128 rows
    sizes = [b for b in GATE_BATCHES if b <= 128]
    assert gate(triton_target.device, dtype, *shape, sizes) == sizes


@pytest.mark.parametrize("head", ["split", "cublas", "tile"], indirect=True)
def test_invariance_gate_at_thousands_of_rows(triton_target, head, monkeypatch):
    """Batches of 4095, 4096 and 8192 rows (several chunks of every head, the cublas head's
    last one padded) on the big tile in bf16: about two minutes per head under the
    interpreter, so make test-full's; seconds on a GPU."""
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", str(1 << 16))
    sizes = [b for b in GATE_BATCHES if b > 128]
    assert gate(triton_target.device, torch.bfloat16, 64, 32, sizes) == sizes


# ------------------------------------------------------------------------------- the choice
def test_a_forced_head_is_used_and_a_bad_one_refused(monkeypatch):
    hidden, weight = torch.zeros(2, 8), torch.zeros(5, 8)
    for name in linear_heads.HEADS:
        monkeypatch.setenv(linear_heads.HEAD_ENV, name)
        assert linear_heads.head_for(hidden, weight, measure=_fail_if_called) == name
    monkeypatch.setenv(linear_heads.HEAD_ENV, "fastest")
    with pytest.raises(ValueError, match=r"PORTARL_LINEAR_HEAD='fastest': must be one of auto, split, cublas, tile"):
        linear_heads.head_for(hidden, weight)
    monkeypatch.setenv(linear_heads.HEAD_ENV, "auto")
    assert linear_heads.head_for(hidden, weight, measure=_fail_if_called) == "tile"  # CPU: nothing timed


def _fail_if_called(*_):
    raise AssertionError("measured where it must not")


def test_the_fastest_head_that_ran_is_chosen():
    assert linear_heads.choose({"split": 2e-3, "cublas": 1e-3, "tile": 9e-3}) == "cublas"
    assert linear_heads.choose({"split": 2e-3, "cublas": None, "tile": 9e-3}) == "split"
    assert linear_heads.choose({"split": 1e-3, "cublas": 1e-3, "tile": 1e-3}) == "split"  # ties: HEADS order
    assert linear_heads.choose({"split": None, "cublas": None, "tile": None}) == "tile"


class _GPU:
    """Operands that say they live on a GPU, for the choice logic alone (nothing runs on them)."""

    def __init__(self, dtype, width, vocab):
        self.device = torch.device("cuda", 0)
        self.dtype, self.shape = dtype, (vocab, width)


def test_a_measured_choice_is_kept_for_the_process_cached_on_disk_and_logged(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PORTARL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(linear_heads.HEAD_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    linear_heads.reset()
    calls = []

    def measure(hidden, weight):
        calls.append(weight.shape)
        return {"split": 3e-3, "cublas": 2e-3, "tile": 40e-3}

    hidden, weight = _GPU(torch.bfloat16, 896, 151_936), _GPU(torch.bfloat16, 896, 151_936)
    weight.shape = (151_936, 896)
    with caplog.at_level(logging.INFO, logger="portarl.ops"):
        assert linear_heads.head_for(hidden, weight, measure=measure) == "cublas"
        assert linear_heads.head_for(hidden, weight, measure=measure) == "cublas"
    assert len(calls) == 1, "measured once per (device, dtype, H, V) and process"
    line = next(r.getMessage() for r in caplog.records if "linear log-probs head" in r.getMessage())
    assert "NVIDIA H200 bfloat16 H=896 V=151936: cublas" in line and "split 3.00 ms, cublas 2.00 ms, tile 40.00 ms" in line
    saved = json.loads((tmp_path / "linear-heads.json").read_text())
    [(key, choice)] = saved.items()
    assert choice == "cublas" and key.startswith("NVIDIA H200 | torch ") and key.endswith("bfloat16 H=896 V=151936")
    linear_heads.reset()  # a new process on the same machine: the cache, no timing
    assert linear_heads.head_for(hidden, weight, measure=_fail_if_called) == "cublas"
    other = _GPU(torch.bfloat16, 896, 151_936)
    other.shape = (32_000, 896)  # another V: measured again
    assert linear_heads.head_for(hidden, other, measure=measure) == "cublas" and len(calls) == 2
    (tmp_path / "linear-heads.json").write_text("{not json")
    linear_heads.reset()
    with caplog.at_level(logging.WARNING, logger="portarl.ops"):
        assert linear_heads.head_for(hidden, weight, measure=measure) == "cublas"
    assert any("ignoring the linear head cache" in r.getMessage() for r in caplog.records)
    linear_heads.reset()


@pytest.mark.parametrize("head", HEADS, indirect=True)
def test_each_head_keeps_the_memory_contract(triton_target, head, monkeypatch):
    """No N x V tensor in either direction and temporaries bounded by the chunk budget
    (test_linear_logprobs_contract.py's checks, on each head)."""
    from test_linear_logprobs_contract import test_extra_memory_does_not_grow_with_rows, \
        test_no_n_by_v_tensor_in_either_direction

    test_no_n_by_v_tensor_in_either_direction(triton_target, monkeypatch, True)
    test_extra_memory_does_not_grow_with_rows(triton_target, monkeypatch)
