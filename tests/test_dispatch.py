"""Backend choice: explicit argument, PORTARL_BACKEND, the device's own backend, and
recorded (never silent) fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch

from portarl import BackendUnavailableError, ops
from portarl.backends import dispatch, fallback_counts, fallbacks


def _call(**kw):
    return ops.logprobs(torch.randn(2, 5), torch.tensor([1, 2]), **kw)


def test_cpu_default_is_reference():
    assert ops.computed_by(_call()) == "reference"
    assert fallbacks() == []


def test_env_forces_a_backend(monkeypatch):
    monkeypatch.setenv("PORTARL_BACKEND", "reference")
    assert ops.computed_by(_call()) == "reference"
    assert ops.computed_by(ops.kl(torch.randn(3), torch.randn(3))) == "reference"


def test_env_with_unknown_backend(monkeypatch):
    monkeypatch.setenv("PORTARL_BACKEND", "tpu")
    with pytest.raises(ValueError, match="tpu"):
        _call()


def test_explicit_unusable_backend_raises_with_reason():
    with pytest.raises(BackendUnavailableError, match="'npu' backend, which cannot run logprobs on cpu"):
        _call(backend="npu")


def test_fallback_is_logged_and_recorded(monkeypatch, caplog):
    """A device whose own backend cannot run goes to reference, with a record and a debug log."""
    monkeypatch.setitem(dispatch._NATIVE, "cpu", "npu")  # pretend CPU's own backend is npu (absent here)
    with caplog.at_level(logging.DEBUG, logger="portarl.dispatch"):
        out = _call()
        _call()
    assert ops.computed_by(out) == "reference"
    record = fallbacks()[0]
    assert (record.op, record.wanted, record.used, record.device) == ("logprobs", "npu", "reference", "cpu")
    assert "torch_npu" in record.reason
    assert fallback_counts() == {("logprobs", "npu", "reference"): 2}
    assert any("npu backend unavailable" in m for m in caplog.messages)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    import portarl.kernels

    monkeypatch.setattr(portarl.kernels, "INTERPRETED", False)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET|interpreter"):
        _call(backend="cuda")
