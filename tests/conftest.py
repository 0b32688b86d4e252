"""Shared test set-up: device-generic targets (one test body, every backend available here).

A *target* is a backend plus the device its tensors live on:

- ``reference-cpu``: the pure-PyTorch backend;
- ``cuda-interpreted``: the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``
  (how CI runs every kernel);
- ``npu-standin``: the npu backend's logic over a CPU stand-in for torch_npu
  (tests/npu_standin.py); marked ``npu_standin``; NOT hardware parity;
- ``cuda-gpu`` / ``npu-hardware``: real devices, marked ``gpu`` / ``npu`` and skipped, with
  the reason, where absent;
- ``triton-npu``: the Triton kernels on an NPU through triton-ascend (marked ``npu``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path

import torch

# The Triton interpreter must be chosen before portarl's kernels are decorated; on a GPU
# machine the kernels are compiled for the GPU instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

import npu_standin  # noqa: E402

from portarl.backends import get_backend_by_name  # noqa: E402
from portarl.backends.npu import torch_npu_api  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Target:
    id: str
    backend: str
    device: str
    standin: bool = False

    @contextlib.contextmanager
    def active(self):
        if self.standin:
            npu_standin.calls.clear()
            with torch_npu_api.use_module(npu_standin, serves_device_type="cpu"):
                yield self
        else:
            yield self


def _cuda_interpreted() -> bool:
    try:
        return get_backend_by_name("cuda").unavailable_reason(torch.device("cpu")) is None
    except Exception:
        return False


def _npu_hardware_reason() -> str | None:
    return torch_npu_api.unavailable_reason()


def _triton_npu_reason() -> str | None:
    npu = torch_npu_api.unavailable_reason()  # first: without torch_npu, "npu" is no device type
    return npu or get_backend_by_name("triton").unavailable_reason(torch.device("npu"))


def _all_targets():
    yield pytest.param(Target("reference-cpu", "reference", "cpu"), id="reference-cpu")
    yield pytest.param(
        Target("cuda-interpreted", "cuda", "cpu"),
        id="cuda-interpreted",
        marks=pytest.mark.skipif(not _cuda_interpreted(), reason="Triton kernels not built for the interpreter (set TRITON_INTERPRET=1)"),
    )
    yield pytest.param(Target("npu-standin", "npu", "cpu", standin=True), id="npu-standin", marks=pytest.mark.npu_standin)
    yield pytest.param(Target("cuda-gpu", "cuda", "cuda"), id="cuda-gpu", marks=pytest.mark.gpu)
    yield pytest.param(Target("npu-hardware", "npu", "npu"), id="npu-hardware", marks=pytest.mark.npu)
    # portarl's Triton kernels on the NPU (triton-ascend): skipped, with the reason, where it is absent.
    yield pytest.param(Target("triton-npu", "triton", "npu"), id="triton-npu",
                       marks=[pytest.mark.npu, pytest.mark.skipif(_triton_npu_reason() is not None,
                                                                  reason=f"{_triton_npu_reason()}")])


ALL_TARGETS = list(_all_targets())
#: Targets whose logprobs backend runs the Triton kernels (batch invariance is theirs).
TRITON_TARGETS = [p for p in ALL_TARGETS if p.values[0].backend in ("cuda", "triton")]
HARDWARE_TARGETS = [p for p in ALL_TARGETS if p.values[0].device != "cpu"]


@pytest.fixture(params=ALL_TARGETS)
def target(request):
    with request.param.active() as t:
        yield t


@pytest.fixture(params=TRITON_TARGETS)
def triton_target(request):
    with request.param.active() as t:
        yield t


@pytest.fixture(params=HARDWARE_TARGETS)
def hardware_target(request):
    with request.param.active() as t:
        yield t


@pytest.fixture
def standin():
    """Run the npu backend over the CPU stand-in (label: npu_standin, not hardware parity)."""
    npu_standin.calls.clear()
    npu_standin.options.clear()
    with torch_npu_api.use_module(npu_standin, serves_device_type="cpu"):
        yield npu_standin


@pytest.fixture(autouse=True)
def _clean_dispatch_state(monkeypatch):
    from portarl.backends import clear_fallbacks

    monkeypatch.delenv("PORTARL_BACKEND", raising=False)
    clear_fallbacks()
    yield


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the slower end-to-end variants listed in tests/suite_budget.py (make test-full)")
    # (PORTARL_TEST_FULL=1 does the same: tests/suite_budget.py)


def _skip_full_only(config, items) -> None:
    """The slower end-to-end variants ``make test`` leaves to ``make test-full``
    (tests/suite_budget.py: each with the tests that keep its property covered)."""
    from suite_budget import check_full_only, full_suite

    reasons = check_full_only(items)
    if full_suite(config):
        return
    for item in items:
        if item.nodeid in reasons:
            item.add_marker(pytest.mark.skip(reason=reasons[item.nodeid]))


def pytest_collection_modifyitems(config, items):
    _skip_full_only(config, items)
    cuda_reason = None if torch.cuda.is_available() else "needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    npu_reason = _npu_hardware_reason()
    for item in items:
        if cuda_reason and item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=cuda_reason))
        if npu_reason and item.get_closest_marker("npu") is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs an Ascend NPU: {npu_reason}"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test marked ``compares_runs`` that passes without calling the guard of
    tests/run_guard.py fails: its comparison could hold on runs whose weights never moved."""
    if item.get_closest_marker("compares_runs") is None:
        return (yield)
    import run_guard

    before = len(run_guard.calls)
    result = yield
    run_guard.require_guard_called(item.nodeid, before)
    return result
