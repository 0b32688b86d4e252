"""ops.linear_logprobs forward and every gradient against float64, every target x dtype x shape.

Shapes: V in {1, 17, 2048, 4099, 32000}, H in {8, 64, 896}, leading batch dims, non-contiguous
hidden, all rows ignored, bias, temperature; a tied weight used twice in one graph. The
big shapes (V 32000, H 896) use few rows: the Triton interpreter is slow. V 2048 x H 64
runs the Triton backend's big tiles (H and V multiples of 16).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from portarl import ops
from portarl.parity.errors import assert_close
from portarl.parity.float64 import linear_logprobs_float64
from portarl.parity.tolerances import contracted_gradient, fp32_result

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lead: tuple
    vocab: int
    hidden: int
    bias: bool = False
    temperature: float = 1.0
    strided: bool = False
    ignore: str = "some"  # "some" | "all" | "none"
    seed: int = 0

    def make(self, dtype, device):
        gen = torch.Generator().manual_seed(self.seed)
        lead = self.lead
        full = (*lead[:-1], lead[-1] + 1, self.hidden) if self.strided else (*lead, self.hidden)
        h = torch.randn(full, generator=gen)
        if self.strided:
            h = h[..., 1:, :]  # a slice: not viewable as one [N, H] block without a copy
        w = torch.randn(self.vocab, self.hidden, generator=gen) * (2.0 / self.hidden**0.5)
        b = torch.randn(self.vocab, generator=gen) if self.bias else None
        labels = torch.randint(0, self.vocab, lead, generator=gen)
        if self.ignore == "all":
            labels.fill_(-100)
        elif self.ignore == "some" and labels.numel() > 1:
            labels.view(-1)[::3] = -100
        cast = lambda t: None if t is None else t.to(dtype).to(device)  # noqa: E731
        return cast(h), cast(w), cast(b), labels.to(device)


CASES = [
    Case("v1_h8", (5,), 1, 8),
    Case("v17_h8_bias_t07", (2, 7), 17, 8, bias=True, temperature=0.7, seed=1),
    Case("v17_h64_strided", (3, 4), 17, 64, strided=True, seed=2),
    Case("v4099_h64_batch", (2, 5), 4099, 64, bias=True, seed=3),
    Case("v4099_h8_all_ignored", (2, 3), 4099, 8, ignore="all", seed=4),
    Case("v32000_h8", (2, 2), 32000, 8, bias=True, seed=7),
    Case("v32000_h896", (3,), 32000, 896, ignore="none", seed=5),
    Case("v4099_h896_strided_t13", (1, 2), 4099, 896, strided=True, temperature=1.3, seed=6),
    # H and V multiples of 16: the Triton backend's big (tensor-core) tiles
    Case("v2048_h64_aligned_bias", (3, 7), 2048, 64, bias=True, temperature=0.9, seed=8),
]


def _check_case(target, case, dtype, monkeypatch=None):
    h, w, b, labels = case.make(dtype, target.device)
    gen = torch.Generator().manual_seed(case.seed + 100)
    g1 = torch.randn(labels.shape, generator=gen)
    g2 = torch.randn(labels.shape, generator=gen)
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (h, w, b)]
    logp, ent = ops.linear_logprobs(leaves[0], leaves[1], labels, bias=leaves[2], temperature=case.temperature,
                                    return_entropy=True, backend=target.backend)
    assert logp.dtype == torch.float32 and logp.shape == labels.shape and ops.computed_by(logp) == target.backend
    (logp * g1.to(target.device) + ent * g2.to(target.device)).sum().backward()
    ref = linear_logprobs_float64(h, w, labels, bias=b, temperature=case.temperature, grad_logp=g1, grad_entropy=g2)
    z = h.double().cpu() @ w.double().cpu().T + (b.double().cpu() if b is not None else 0.0)
    scale = float(z.abs().max()) / case.temperature
    assert_close(logp, ref["logp"], fp32_result(scale), f"{case.name} {NAMES[dtype]} logp")
    assert_close(ent, ref["entropy"], fp32_result(scale), f"{case.name} {NAMES[dtype]} entropy")
    gz = ref["grad_logits"].abs().reshape(-1, case.vocab)
    mass_h = float((gz.sum(-1)).max()) * float(w.double().abs().max())
    mass_w = float(gz.sum(0).max()) * float(h.double().abs().max())
    assert leaves[0].grad.dtype == dtype and leaves[1].grad.dtype == dtype
    assert_close(leaves[0].grad, ref["grad_hidden"], contracted_gradient(scale, mass_h, dtype), f"{case.name} grad_hidden")
    assert_close(leaves[1].grad, ref["grad_weight"], contracted_gradient(scale, mass_w, dtype), f"{case.name} grad_weight")
    if b is not None:
        assert_close(leaves[2].grad, ref["grad_bias"], contracted_gradient(scale, float(gz.sum(0).max()), dtype),
                     f"{case.name} grad_bias")
    if case.ignore == "all":
        assert torch.count_nonzero(logp) == 0 and torch.count_nonzero(leaves[0].grad) == 0
        assert torch.count_nonzero(leaves[1].grad) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: NAMES[d])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_linear_logprobs_matches_float64(target, case, dtype):
    if target.id == "cuda-interpreted" and case.vocab * case.hidden > 4_000_000:
        pytest.skip("V 32000 x H 896 is too slow for the Triton interpreter; runs on hardware (cuda-gpu)")
    _check_case(target, case, dtype)


def test_small_chunks_give_the_same_numbers(target, monkeypatch):
    """A tiny budget forces many row chunks and vocabulary blocks; still within tolerance."""
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", "512")
    _check_case(target, Case("chunked", (4, 6), 301, 24, bias=True, seed=9), torch.float32)


def test_tied_weight_used_twice_in_one_graph(target):
    """An embedding tied to the head: both uses' gradients add up in the one weight."""
    gen = torch.Generator().manual_seed(11)
    vocab, width = 37, 16
    weight = (torch.randn(vocab, width, generator=gen) * 0.5).to(target.device).requires_grad_(True)
    ids = torch.randint(0, vocab, (2, 5), generator=gen).to(target.device)
    labels = torch.randint(0, vocab, (2, 5), generator=gen).to(target.device)
    hidden = torch.tanh(torch.nn.functional.embedding(ids, weight))
    logp = ops.linear_logprobs(hidden, weight, labels, backend=target.backend)
    logp.sum().backward()
    w64 = weight.detach().double().cpu().requires_grad_(True)
    h64 = torch.tanh(torch.nn.functional.embedding(ids.cpu(), w64))
    ref = torch.log_softmax(h64 @ w64.T, -1).gather(-1, labels.cpu().unsqueeze(-1)).sum()
    (expected,) = torch.autograd.grad(ref, w64)
    assert_close(weight.grad, expected, contracted_gradient(4.0, 2 * 10 * 4.0, torch.float32), "tied weight grad")


def test_nan_rows_are_nan_and_others_finite(target):
    h = torch.randn(4, 8, device=target.device)
    h[1, 3] = float("nan")
    w = torch.randn(19, 8, device=target.device)
    logp, ent = ops.linear_logprobs(h, w, torch.tensor([1, 2, 3, 4], device=target.device), return_entropy=True,
                                    backend=target.backend)
    assert torch.isnan(logp[1]) and torch.isnan(ent[1])
    assert torch.isfinite(logp[[0, 2, 3]]).all() and torch.isfinite(ent[[0, 2, 3]]).all()


def test_no_rows(target):
    h = torch.randn(0, 8, device=target.device, requires_grad=True)
    w = torch.randn(5, 8, device=target.device, requires_grad=True)
    logp = ops.linear_logprobs(h, w, torch.zeros(0, dtype=torch.int64, device=target.device), backend=target.backend)
    assert logp.shape == (0,)
    logp.sum().backward()
    assert w.grad.shape == (5, 8) and torch.count_nonzero(w.grad) == 0


def test_errors_name_the_argument():
    h, w, y = torch.randn(3, 8), torch.randn(11, 8), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="weight must be 2-D"):
        ops.linear_logprobs(h, w.view(-1), y)
    with pytest.raises(ValueError, match="hidden.shape.-1. must equal weight.shape.1."):
        ops.linear_logprobs(h, w.T.contiguous(), y)
    with pytest.raises(TypeError, match="hidden is torch.bfloat16 but weight is torch.float32"):
        ops.linear_logprobs(h.bfloat16(), w, y)
    with pytest.raises(TypeError, match="hidden has dtype torch.float64"):
        ops.linear_logprobs(h.double(), w.double(), y)
    with pytest.raises(ValueError, match=r"labels: 1 value\(s\) outside \[0, 11\)"):
        ops.linear_logprobs(h, w, torch.tensor([0, 11, 2]))
    with pytest.raises(ValueError, match="labels shape"):
        ops.linear_logprobs(h, w, y[:2])
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        ops.linear_logprobs(h, w, y.float())
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        ops.linear_logprobs(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match=r"bias must be \[V\]"):
        ops.linear_logprobs(h, w, y, bias=torch.zeros(10))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: NAMES[d])
def test_sweep_runner_passes(target, dtype):
    """The runner `portarl parity` uses for linear_logprobs (small case here; the sweep has all)."""
    from portarl.parity.linear_sweep import run_linear_logprobs_case, standard_linear_cases

    case = standard_linear_cases()[0]
    records = run_linear_logprobs_case(case, target.backend, dtype, torch.device(target.device), repeats=0)
    assert {r.quantity for r in records} == {"logp", "entropy", "grad_hidden", "grad_weight"}
    failed = [(r.quantity, r.error, r.worst_ratio) for r in records if not r.passed]
    assert not failed, failed
