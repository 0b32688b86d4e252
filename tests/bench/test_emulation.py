"""NPU numerics EMULATION switches (portarl.backends.emulation): each does what its source documents."""

from __future__ import annotations

import pytest
import torch

from portarl.bench.stability import parse_runs
from portarl.backends.emulation import PROFILES, SWITCHES, HF32Matmuls, resolve_profile, round_mantissa
from portarl.trainer.phases.sequences import build_batch, completion_logprobs


def test_default_profile_holds_only_stack_defaults():
    assert set(PROFILES["npu-emulated"]) == {n for n, s in SWITCHES.items() if s.stack_default}
    assert "hf32_matmul" not in PROFILES["npu-emulated"]
    assert all(s.source for s in SWITCHES.values())
    with pytest.raises(ValueError, match="unknown emulation switch"):
        resolve_profile(["fast_math"])


def test_round_mantissa_keeps_ten_bits():
    x = torch.tensor([1.0 + 2**-10, 1.0 + 2**-11 + 2**-12, float("inf"), float("nan")])
    y = round_mantissa(x, 10)
    assert y[0] == 1.0 + 2**-10 and y[1] == 1.0 + 2**-10 and torch.isinf(y[2]) and torch.isnan(y[3])


def test_hf32_mode_rounds_fp32_matmul_inputs():
    a = torch.full((1, 1), 1.0 + 2**-13)
    b = torch.ones(1, 1)
    assert (a @ b).item() != 1.0
    with HF32Matmuls():
        assert (a @ b).item() == 1.0
        assert torch.nn.functional.linear(a, b).item() == 1.0


def _batch_and_model():
    from portarl.assets.models import build_tiny

    model, tok = build_tiny(seed=1, hidden_size=32, intermediate_size=64)
    model = model.to(torch.bfloat16)
    batch = build_batch([tok.encode("1+2="), tok.encode("3+4=")], [[6, 2], [10, 2]], tok.pad_token_id, "cpu")
    return model, batch


def test_bf16_logprobs_and_entropy_without_upcast_differ_from_portarl():
    model, batch = _batch_and_model()
    logp, ent = completion_logprobs(model, batch, temperature=1.0, with_entropy=True)
    e_logp, e_ent = completion_logprobs(model, batch, temperature=1.0, with_entropy=True,
                                        emulate=resolve_profile("npu-emulated"))
    valid = batch.mask
    assert torch.equal(e_logp[valid], e_logp[valid].to(torch.bfloat16).float())  # bf16-valued
    assert not torch.equal(logp[valid], e_logp[valid])
    assert (logp[valid] - e_logp[valid]).abs().max() < 0.05  # a bf16 rounding step, not a different model
    assert e_ent.dtype == torch.float32 and torch.equal(e_ent[~valid], torch.zeros_like(e_ent[~valid]))
    leaf_logp = completion_logprobs(model, batch, temperature=1.0, emulate=resolve_profile("npu-emulated"))
    leaf_logp.sum().backward()  # the gradient passes through the bf16 rounding
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_parse_runs():
    specs = parse_runs("cpu:fp32, cpu:bf16:npu-emulated, cuda:bf16:reference")
    assert [s.label for s in specs] == ["cpu:fp32", "cpu:bf16:npu-emulated", "cuda:bf16:reference"]
    assert specs[1].emulated and not specs[2].emulated
    assert "precision.numerics=npu-emulated" in specs[1].overrides()
    assert "precision.backend=reference" in specs[2].overrides()
    with pytest.raises(ValueError, match="dtype must be"):
        parse_runs("cpu:fp64")
    with pytest.raises(ValueError, match="twice"):
        parse_runs("cpu:fp32,cpu:fp32")
