"""Persistent grids (portarl.backends.cuda.grid): no launch of portarl's Triton kernels has
more than MAX_PROGRAMS programs (Ascend refuses more than 65535), and a program that loops
over several rows, items or tiles computes exactly what one program per item computed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from portarl import ops  # noqa: E402
from portarl.backends.cuda import grid  # noqa: E402

ROWS = 1_000_000


def _interpreted():
    from portarl.backends import get_backend_by_name

    return get_backend_by_name("cuda").unavailable_reason(torch.device("cpu")) is None


needs_interpreter = pytest.mark.skipif(not _interpreted(), reason="Triton kernels not built for the interpreter")


def _all_ops(seed: int) -> dict[str, torch.Tensor]:
    """Every Triton kernel, forward and backward: logprobs (both backward variants),
    linear_logprobs, kl; results and gradients."""
    from portarl.backends.cuda.logprobs import triton_logprobs

    gen = torch.Generator().manual_seed(seed)
    out = {}
    logits = torch.randn(7, 50, generator=gen).to(torch.bfloat16)
    labels = torch.tensor([1, -100, 49, 3, 0, 7, 20])
    for inplace in (False, True):
        leaf = logits.clone().requires_grad_(True)
        src = leaf.clone() if inplace else leaf  # in place: the op overwrites its own logits copy
        logp, ent = triton_logprobs(src, labels, temperature=0.7, ignore_index=-100, return_entropy=True,
                                    inplace_backward=inplace)
        (logp.sum() + ent.sum()).backward()
        out[f"logprobs{inplace}"], out[f"entropy{inplace}"], out[f"grad{inplace}"] = logp, ent, leaf.grad
    hidden = torch.randn(9, 8, generator=gen, requires_grad=True)
    weight = torch.randn(70, 8, generator=gen, requires_grad=True)
    bias = torch.randn(70, generator=gen, requires_grad=True)
    lin_labels = torch.tensor([1, 5, 69, -100, 0, 2, 3, 4, 68])
    lp, h = ops.linear_logprobs(hidden, weight, lin_labels, bias=bias, return_entropy=True, backend="cuda")
    (lp.sum() + h.sum()).backward()
    out.update(linear=lp, linear_h=h, g_hidden=hidden.grad, g_weight=weight.grad, g_bias=bias.grad)
    a = torch.randn(3, 900, generator=gen, requires_grad=True)
    b = torch.randn(3, 900, generator=gen, requires_grad=True)
    kl = ops.kl(a, b, estimator="k3", mask=torch.rand(3, 900, generator=gen) > 0.2, backend="cuda")
    kl.sum().backward()
    out.update(kl=kl, g_a=a.grad, g_b=b.grad)
    return out


@needs_interpreter
def test_results_do_not_depend_on_the_number_of_programs(monkeypatch, tmp_path):
    monkeypatch.setenv("PORTARL_CHUNK_ELEMENTS", "256")  # several linear chunks, several tiles per chunk
    one_per_item = _all_ops(0)
    monkeypatch.setattr(grid, "MAX_PROGRAMS", 2)  # every kernel loops over many items per program
    looped = _all_ops(0)
    for key, value in one_per_item.items():
        assert torch.equal(looped[key], value), key


class _Recorder:
    """Stands in for a Triton kernel: records each launch's grid and arguments, runs nothing."""

    def __init__(self, kernel, launches):
        self.arg_names, self.launches, self.name = kernel.arg_names, launches, kernel.__name__

    def __getitem__(self, launch_grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, tuple(launch_grid), dict(zip(self.arg_names, args))))

        return launch


def test_no_launch_exceeds_the_program_limit_at_a_million_rows(monkeypatch):
    import portarl.backends.cuda.kl as host_kl
    import portarl.backends.cuda.linear_logprobs as host_linear
    import portarl.backends.cuda.logprobs as host_logprobs

    launches: list = []
    for module, names in ((host_logprobs, ("logprobs_forward_kernel", "logprobs_grad_kernel")),
                          (host_kl, ("kl_forward_kernel", "kl_backward_kernel")),
                          (host_linear, ("linear_tile_kernel", "tile_logprobs_forward_kernel",
                                         "tile_logprobs_backward_kernel"))):
        for name in names:
            monkeypatch.setattr(module, name, _Recorder(getattr(module, name), launches))
    logits = torch.zeros(ROWS, 4)
    labels = torch.zeros(ROWS, dtype=torch.int64)
    logp, lse, ent = host_logprobs.forward_rows(logits, labels, 1.0, -100, True)
    host_logprobs.backward_rows(logits, labels, lse, ent, torch.ones(ROWS), torch.ones(ROWS), 1.0, -100)
    x = torch.zeros(ROWS, 1, requires_grad=True)
    host_kl.triton_kl(x, torch.zeros(ROWS, 1), estimator="k3", mask=None, log_ratio_clamp=20.0,
                      max_value=10.0).sum().backward()
    hidden = torch.zeros(ROWS, 2, requires_grad=True)
    weight = torch.zeros(3, 2, requires_grad=True)
    lp, _ = host_linear.triton_linear_logprobs(hidden, weight, None, labels, temperature=1.0, ignore_index=-100,
                                               return_entropy=False)
    lp.sum().backward()
    kernels = {name for name, _, _ in launches}
    assert kernels == {"logprobs_forward_kernel", "logprobs_grad_kernel", "kl_forward_kernel", "kl_backward_kernel",
                       "linear_tile_kernel", "tile_logprobs_forward_kernel", "tile_logprobs_backward_kernel"}
    for name, launch_grid, args in launches:
        assert len(launch_grid) == 1 and 1 <= launch_grid[0] <= grid.MAX_PROGRAMS == 65535, (name, launch_grid)
    # The loops cover everything: each row kernel is told the rows it walks.
    assert {args["n_rows"] for name, _, args in launches if name.startswith("logprobs")} == {ROWS}
    chunk_rows = sum(args["n_rows"] for name, _, args in launches if name == "tile_logprobs_forward_kernel")
    assert chunk_rows == ROWS


def test_programs_is_capped_and_never_empty():
    assert grid.programs(0) == (1,) and grid.programs(1) == (1,) and grid.programs(65535) == (65535,)
    assert grid.programs(10**9) == (65535,)
