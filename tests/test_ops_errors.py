"""Bad input to the public ops gets a clear error naming the argument and the fix."""

from __future__ import annotations

import math

import pytest
import torch

from portarl import ops


def _inputs(n=4, v=10):
    return torch.randn(n, v), torch.randint(0, v, (n,))


@pytest.mark.parametrize("bad_label", [10, 11, -1, -101])
def test_labels_outside_vocab(target, bad_label):
    logits, labels = _inputs()
    labels[2] = bad_label
    with pytest.raises(ValueError, match=r"labels: 1 value\(s\) outside \[0, 10\).*ignore_index=-100"):
        ops.logprobs(logits.to(target.device), labels.to(target.device), backend=target.backend)


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf])
def test_bad_temperature(target, temperature):
    logits, labels = _inputs()
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        ops.logprobs(logits.to(target.device), labels.to(target.device), temperature=temperature, backend=target.backend)


def test_temperature_must_be_a_number():
    logits, labels = _inputs()
    with pytest.raises(TypeError, match="temperature must be a Python number"):
        ops.logprobs(logits, labels, temperature=torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_unsupported_logits_dtype(dtype):
    logits, labels = _inputs()
    with pytest.raises(TypeError, match=r"logits has dtype .* pass float32, bfloat16 or float16"):
        ops.logprobs(logits.to(dtype), labels)


def test_float_labels():
    logits, labels = _inputs()
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        ops.logprobs(logits, labels.float())


def test_shape_mismatch():
    logits, labels = _inputs()
    with pytest.raises(ValueError, match=r"labels shape \(3,\) must equal logits.shape\[:-1\] = \(4,\)"):
        ops.logprobs(logits, labels[:3])


def test_empty_vocab():
    with pytest.raises(ValueError, match="V >= 1"):
        ops.logprobs(torch.randn(3, 0), torch.zeros(3, dtype=torch.int64))


def test_non_tensor_inputs():
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        ops.logprobs([[0.0, 1.0]], torch.zeros(1, dtype=torch.int64))


def test_kl_errors():
    a, b = torch.randn(5), torch.randn(5)
    with pytest.raises(ValueError, match="estimator='k4' is not one of k1, k2, k3"):
        ops.kl(a, b, estimator="k4")
    with pytest.raises(ValueError, match="must match"):
        ops.kl(a, b[:4])
    with pytest.raises(ValueError, match="mask shape"):
        ops.kl(a, b, mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="ref_logp has dtype torch.float64"):
        ops.kl(a, b.double())
    with pytest.raises(ValueError, match="log_ratio_clamp must be a finite number > 0 or None"):
        ops.kl(a, b, log_ratio_clamp=-1.0)
    with pytest.raises(ValueError, match="max_value must be a finite number > 0 or None"):
        ops.kl(a, b, max_value=0.0)


def test_devices_must_match():
    logits, labels = _inputs()
    with pytest.raises(ValueError, match="one device: logits on cpu, labels on meta"):
        ops.logprobs(logits, labels.to("meta"))


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 9.9e-7])
def test_temperature_that_overflows_finite_logits_is_refused(target, temperature):
    """1/1e-45 is inf in fp32: every finite row would come back NaN. Refused, with the range."""
    logits, labels = _inputs()
    with pytest.raises(ValueError, match=r"temperature=.* is too small.*valid range is \[1e-06, inf\)"):
        ops.logprobs(logits.to(target.device), labels.to(target.device), temperature=temperature, backend=target.backend)


def test_smallest_valid_temperature_keeps_finite_logits_finite(target):
    """The edge of the range is usable: large finite logits stay finite and normalised."""
    from portarl.ops._checks import TEMPERATURE_MIN

    logits = torch.randn(4, 10, dtype=torch.float64) * 1e4
    labels = logits.argmax(-1)
    logp, entropy = ops.logprobs(logits.float().to(target.device), labels.to(target.device),
                                 temperature=TEMPERATURE_MIN, return_entropy=True, backend=target.backend)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    want = torch.log_softmax(logits / TEMPERATURE_MIN, -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(logp.double().cpu(), want, rtol=0, atol=1e-3)


def test_linear_logprobs_takes_the_same_temperature_range():
    """The trainer scores through linear_logprobs: it refuses what ops.logprobs refuses."""
    hidden, weight = torch.randn(3, 8), torch.randn(11, 8)
    labels = torch.tensor([0, 5, 10])
    with pytest.raises(ValueError, match=r"temperature=1e-45 is too small.*\[1e-06, inf\)"):
        ops.linear_logprobs(hidden, weight, labels, temperature=1e-45)
    with pytest.raises(ValueError, match="outside \\[0, 11\\)"):
        ops.linear_logprobs(hidden, weight, torch.tensor([0, 11, 2]))
    assert torch.isfinite(ops.linear_logprobs(hidden, weight, labels, temperature=1e-6)).all()
