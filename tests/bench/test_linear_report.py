"""The linear_logprobs benchmark's Liger column and report, on CPU (Liger needs CUDA; it is
never a dependency): when the column is measured, its skip reasons, the table layout, and
``--shapes`` of ``portarl bench kernels``."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from portarl.bench import linear
from portarl.bench.kernels import KernelResult
from portarl.cli.bench import _parse_shapes


def test_liger_needs_cuda_even_when_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    assert linear.liger_status(torch.device("cpu")) == "needs CUDA"
    assert "liger" not in linear.linear_methods(torch.device("cpu"))


def test_liger_not_installed_on_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import raises ImportError
    assert linear.liger_status(torch.device("cuda")) == "not installed"


def test_liger_measured_on_cuda_when_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    assert linear.liger_status(torch.device("cuda")) is None


def _row(method, mode, ms, mib, error=None):
    return KernelResult("linear_logprobs", method, mode, "bf16", 4096, 151936, median_ms=ms, peak_extra_mb=mib,
                        error=error, h=896)


def test_table_with_liger_measured():
    rows = [_row("portarl:cuda", "fwd", 10.0, 100.0), _row("eager", "fwd", 20.0, 4000.0),
            _row("chunked", "fwd", 30.0, 1000.0), _row("liger", "fwd", 12.5, 150.0),
            _row("portarl:cuda", "fwd+bwd", 30.0, 300.0), _row("eager", "fwd+bwd", 60.0, 6000.0),
            _row("chunked", "fwd+bwd", 90.0, 3000.0), _row("liger", "fwd+bwd", None, None, error="OutOfMemoryError: x")]
    text = linear.linear_table(rows, "H100", liger=None)
    lines = text.splitlines()
    assert lines[0] == "Conditions: H100" and lines[1] == "liger: measured"
    assert lines[3] == ("| N | H | V | dtype | mode | eager | chunked | portarl:cuda | liger | "
                        "portarl:cuda vs eager (time, memory) |")
    assert lines[4].count("---") == 10
    assert lines[5] == ("| 4096 | 896 | 151936 | bf16 | fwd | 20.0 ms / 4000.0 MiB | 30.0 ms / 1000.0 MiB | "
                        "10.0 ms / 100.0 MiB | 12.5 ms / 150.0 MiB | 0.50x, 0.025x |")
    assert lines[6].endswith("| OutOfMemoryError: x | 0.50x, 0.050x |")
    assert len(lines) == 7


@pytest.mark.parametrize("reason", ["needs CUDA", "not installed"])
def test_table_says_why_liger_is_empty(reason):
    rows = [_row("portarl:reference", "fwd", 10.0, 100.0), _row("eager", "fwd", 20.0, 400.0)]
    lines = linear.linear_table(rows, "cpu", liger=reason).splitlines()
    assert lines[1] == f"liger: {reason}"
    assert lines[5] == (f"| 4096 | 896 | 151936 | bf16 | fwd | 20.0 ms / 400.0 MiB | 10.0 ms / 100.0 MiB | "
                        f"liger: {reason} | 0.50x, 0.250x |")


def test_parse_shapes():
    ops = ["logprobs", "kl", "linear_logprobs"]
    assert _parse_shapes(["4096x896x151936", "64x512"], ops) == ([(64, 512)], [(4096, 896, 151936)])
    assert _parse_shapes([], ops) == ([], [])
    for bad in ("4096", "4096x0x5", "ax5", "1x2x3x4"):
        with pytest.raises(ValueError, match="NxHxV"):
            _parse_shapes([bad], ops)
    # a shape no selected op takes, or a selected op without a shape, is refused (the
    # defaults would otherwise run silently in place of what was asked for)
    with pytest.raises(ValueError, match="is NxV"):
        _parse_shapes(["64x512"], ["linear_logprobs"])
    with pytest.raises(ValueError, match="no NxV shape"):
        _parse_shapes(["4x8x16"], ops)


def test_bench_kernels_rejects_a_bad_shape_before_running(capsys):
    from portarl.cli import main

    assert main(["bench", "kernels", "--device", "cpu", "--ops", "linear_logprobs", "--shapes", "4096x896x"]) == 2
    assert "expected NxV (logprobs, kl) or NxHxV (linear_logprobs)" in capsys.readouterr().err


def test_forward_only_mode_times_no_backward(tmp_path):
    """``--modes fwd``: the CPU table's N 4096 row, where eager's bf16 backward alone takes
    minutes; every row is forward, and each method's numbers are measured."""
    from portarl.cli import main

    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--device", "cpu", "--ops", "linear_logprobs", "--dtypes", "fp32",
                 "--shapes", "16x8x64", "--repeats", "1", "--modes", "fwd", "--out", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["results"]
    assert rows and {r["mode"] for r in rows} == {"fwd"}
    assert all(r["median_ms"] is not None and r["median_ms"] > 0 for r in rows)
    with pytest.raises(ValueError, match="modes"):
        linear.run_linear(torch.device("cpu"), shapes=[(4, 4, 8)], modes=("bwd",))
