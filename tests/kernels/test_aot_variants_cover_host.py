"""The AOT variant lists cover every launch the host code makes (tests/kernels/test_aot_compile.py
compiles the lists, so a launch missing from them would never have been compiled in CI).

The kernels in the host modules are replaced by recorders that log each launch's constexprs,
warps, stages and logits dtype without running; the host is driven over vocabularies that
reach every tile configuration, every dtype, entropy on/off, in place or not, every KL flag.
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

import portarl.backends.cuda.kl as host_kl  # noqa: E402
import portarl.backends.cuda.logprobs as host_lp  # noqa: E402
from portarl.kernels import kl as kernels_kl  # noqa: E402
from portarl.kernels import logprobs as kernels_lp  # noqa: E402

INTERPRETER_ONLY = ("ROUND_BF16", "ROUND_BF16_LOGP", "ROUND_BF16_REF", "BROADCAST_DOT")  # False on a GPU
# Both sides of every power of two up to 2**18, and real vocabularies.
VOCABS = sorted({1 << i for i in range(19)} | {(1 << i) + 1 for i in range(19)} | {32000, 151936})
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_TRITON_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class Recorder:
    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, num_stages=3, **constexprs):
            flags = {k: v for k, v in constexprs.items() if k not in INTERPRETER_ONLY}
            self.log.append((self.kernel.__name__, tuple(sorted(flags.items())), num_warps, num_stages,
                             _TRITON_DTYPE.get(args[0].dtype)))
        return launch


def _key(variant):
    # Declared constexpr parameters only: an int argument the JIT specializes (a stride of 1)
    # is passed positionally, not as a flag.
    params = inspect.signature(variant["kernel"].fn).parameters.values()
    declared = {p.name for p in params if "constexpr" in str(p.annotation)}
    flags = {k: v for k, v in variant["constexprs"].items() if k not in INTERPRETER_ONLY and k in declared}
    return variant["kernel"].__name__, tuple(sorted(flags.items())), variant["num_warps"], variant["num_stages"]


def _check(log, variants):
    compiled = {_key(v) for v in variants}
    missing = {entry[:4] for entry in log} - compiled
    assert not missing, f"launched but not in AOT_VARIANTS: {sorted(missing)[:5]}"
    for name in {e[0] for e in log}:
        launched = {e[4] for e in log if e[0] == name}
        have = {v["signature"][next(iter(v["signature"]))][1:] for v in variants if v["kernel"].__name__ == name}
        assert launched <= have, f"{name}: dtypes {launched - have} never compiled"


def test_logprob_launches_are_covered(monkeypatch):
    log = []
    monkeypatch.setattr(host_lp, "logprobs_forward_kernel", Recorder(kernels_lp.logprobs_forward_kernel, log))
    monkeypatch.setattr(host_lp, "logprobs_grad_kernel", Recorder(kernels_lp.logprobs_grad_kernel, log))
    for v in VOCABS:
        for dtype in DTYPES:
            for entropy in (False, True):
                for inplace in (False, True):
                    logits = torch.zeros(2, v, dtype=dtype, requires_grad=True)
                    work = logits.detach().clone().requires_grad_(True) if inplace else logits
                    labels = torch.zeros(2, dtype=torch.int64)
                    logp, ent = host_lp.triton_logprobs(work * 1 if inplace else work, labels, temperature=1.0,
                                                        ignore_index=-100, return_entropy=entropy,
                                                        inplace_backward=inplace)
                    (logp.sum() + (ent.sum() if entropy else 0)).backward()
    kinds = {e[0] for e in log}
    assert kinds == {"logprobs_forward_kernel", "logprobs_grad_kernel"}
    assert len({e[:4] for e in log}) >= 20
    _check(log, kernels_lp.AOT_VARIANTS)


def test_kl_launches_are_covered(monkeypatch):
    log = []
    monkeypatch.setattr(host_kl, "kl_forward_kernel", Recorder(kernels_kl.kl_forward_kernel, log))
    monkeypatch.setattr(host_kl, "kl_backward_kernel", Recorder(kernels_kl.kl_backward_kernel, log))
    for dtype in DTYPES:
        for estimator in ("k1", "k2", "k3"):
            for mask in (None, torch.ones(8, dtype=torch.bool)):
                for clamp in (None, 20.0):
                    for max_value in (None, 10.0):
                        logp = torch.zeros(8, dtype=dtype, requires_grad=True)
                        out = host_kl.triton_kl(logp, torch.zeros(8, dtype=dtype), estimator=estimator, mask=mask,
                                                log_ratio_clamp=clamp, max_value=max_value)
                        out.sum().backward()
    assert len({e[:4] for e in log}) == 24  # 12 flag combinations x (forward, backward)
    _check(log, kernels_kl.AOT_VARIANTS)


def test_linear_logprob_launches_are_covered(monkeypatch):
    """The fused linear log-probs host: the tile matmul (logits, grad_hidden, grad_weight, with
    and without bias), the row kernels over every row tile size, entropy on and off, every
    dtype; with several row chunks (a small chunk budget)."""
    import portarl.backends.cuda.linear_logprobs as host_lin
    from portarl.kernels import linear_logprobs as kernels_lin

    log = []
    for name in ("linear_tile_kernel", "tile_logprobs_forward_kernel", "tile_logprobs_backward_kernel"):
        monkeypatch.setattr(host_lin, name, Recorder(getattr(kernels_lin, name), log))
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", "4096")
    # row tiles 16 .. 2048; H and V multiples of 16 (the big matmul tiles) or not (the small ones)
    shapes = [(8, v) for v in (1, 17, 33, 65, 129, 257, 513, 1025, 2049)] + [(16, 16), (16, 2048)]
    for width, v in shapes:
        for dtype in DTYPES:
            for entropy in (False, True):
                for with_bias in (False, True):
                    hidden = torch.zeros(3, width, dtype=dtype, requires_grad=True)
                    weight = torch.zeros(v, width, dtype=dtype, requires_grad=True)
                    bias = torch.zeros(v, dtype=dtype, requires_grad=True) if with_bias else None
                    logp, ent = host_lin.TritonLinearLogprobs.apply(hidden, weight, bias, torch.zeros(3, dtype=torch.int64),
                                                                  1.0, -100, entropy)
                    (logp.sum() + (ent.sum() if entropy else 0)).backward()
    assert {e[0] for e in log} == {"linear_tile_kernel", "tile_logprobs_forward_kernel", "tile_logprobs_backward_kernel"}
    assert len({e[:4] for e in log if e[0] != "linear_tile_kernel"}) == 8 * 2 * 2  # 8 row tiles x entropy x fwd/bwd
    _check(log, kernels_lin.AOT_VARIANTS)
    tiles = {_key(v) for v in kernels_lin.AOT_VARIANTS if v["kernel"].__name__ == "linear_tile_kernel"}
    assert {e[:4] for e in log if e[0] == "linear_tile_kernel"} == tiles  # both tile sizes launched, none idle


def test_split_head_launches_are_covered(monkeypatch):
    """The split-vocabulary head (portarl.backends.cuda.linear_split): its forward, merge and
    gradient kernels over both tiles (H and V multiples of 16 or not), every dtype, bias and
    entropy on and off, several row chunks; the contractions are the tile kernel's (above)."""
    import portarl.backends.cuda.linear_logprobs as host_lin
    import portarl.backends.cuda.linear_split as host_split
    from portarl.kernels import linear_logprobs as kernels_lin
    from portarl.kernels import linear_split as kernels_split

    log = []
    for name in ("split_forward_kernel", "split_merge_kernel", "split_grad_logits_kernel"):
        monkeypatch.setattr(host_split, name, Recorder(getattr(kernels_split, name), log))
    monkeypatch.setattr(host_lin, "linear_tile_kernel", Recorder(kernels_lin.linear_tile_kernel, []))
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", "4096")
    for width, v in [(8, 17), (8, 4099), (16, 2048), (16, 151_936)]:
        for dtype in DTYPES:
            for entropy in (False, True):
                for with_bias in (False, True):
                    hidden = torch.zeros(3, width, dtype=dtype, requires_grad=True)
                    weight = torch.zeros(v, width, dtype=dtype, requires_grad=True)
                    bias = torch.zeros(v, dtype=dtype, requires_grad=True) if with_bias else None
                    logp, ent = host_split.SplitLinearLogprobs.apply(hidden, weight, bias,
                                                                     torch.zeros(3, dtype=torch.int64), 1.0, -100,
                                                                     entropy)
                    (logp.sum() + (ent.sum() if entropy else 0)).backward()
    assert {e[0] for e in log} == {"split_forward_kernel", "split_merge_kernel", "split_grad_logits_kernel"}
    _check(log, kernels_split.AOT_VARIANTS)
    assert {e[:4] for e in log} == {_key(v) for v in kernels_split.AOT_VARIANTS}  # every variant launched
