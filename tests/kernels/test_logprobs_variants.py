"""Every launch configuration of the Triton log-prob kernels, under the interpreter.

The tile / warp / stage choice is a function of V (:func:`forward_config`,
:func:`backward_config`); the vocabularies below reach each configuration the host can
pick (checked), and each is held to float64 with the tolerances of
:mod:`portarl.parity.tolerances`, in fp32 and bf16, with and without entropy, with the
gradient written to a new buffer and in place over the logits (2-D grid either way).
"""

from __future__ import annotations

import pytest
import torch

from portarl.backends import get_backend_by_name
from portarl.parity.errors import assert_close
from portarl.parity.float64 import logprobs_float64
from portarl.parity.tolerances import fp32_result, stored_gradient

if get_backend_by_name("cuda").unavailable_reason(torch.device("cpu")) is not None:
    pytest.skip("Triton kernels not built for the interpreter (TRITON_INTERPRET=1)", allow_module_level=True)

from portarl.backends.cuda.logprobs import backward_rows, forward_rows, triton_logprobs  # noqa: E402
from portarl.kernels.logprobs import CONFIG_VOCABS, backward_config, forward_config  # noqa: E402

# One V per configuration: blocks 16 .. 4096 in one tile, then several forward tiles.
VOCABS = [1, 17, 33, 100, 200, 300, 600, 1500, 3000, 4097]
TEMPERATURE = 0.7


def _key(config):
    return tuple(sorted(config.items()))


def test_vocabs_reach_every_configuration():
    assert {_key(forward_config(v)) for v in VOCABS} == {_key(forward_config(v)) for v in CONFIG_VOCABS}
    assert {_key(backward_config(v)) for v in VOCABS} == {_key(backward_config(v)) for v in CONFIG_VOCABS}
    assert forward_config(4097)["num_stages"] == 2 and forward_config(4096)["num_stages"] == 1
    assert len({_key(forward_config(v)) for v in VOCABS}) == 10 and len({_key(backward_config(v)) for v in VOCABS}) == 8


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_configuration_matches_float64_and_in_place_is_identical(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    scale = 4.0
    logits = (scale * torch.randn(3, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, (3,), generator=gen)
    labels[1] = -100
    g_logp, g_ent = torch.randn(3, generator=gen), torch.randn(3, generator=gen)
    ref = logprobs_float64(logits, labels, temperature=TEMPERATURE, grad_logp=g_logp, grad_entropy=g_ent)
    grads = {}
    for inplace in (False, True):
        leaf = logits.detach().requires_grad_(True)
        work = leaf * 1  # an intermediate this test owns: the in-place backward may overwrite it
        logp, ent = triton_logprobs(work, labels, temperature=TEMPERATURE, ignore_index=-100, return_entropy=True,
                                    inplace_backward=inplace)
        torch.autograd.backward((logp, ent), (g_logp, g_ent))
        assert_close(logp, ref["logp"], fp32_result(scale / TEMPERATURE), f"logp V={vocab}")
        assert_close(ent, ref["entropy"], fp32_result(scale / TEMPERATURE), f"entropy V={vocab}")
        upstream = float(torch.cat([g_logp, g_ent]).abs().max()) / TEMPERATURE
        assert_close(leaf.grad, ref["grad"], stored_gradient(scale / TEMPERATURE, upstream, dtype), f"grad V={vocab}")
        assert leaf.grad.dtype == dtype and torch.count_nonzero(leaf.grad[1]) == 0
        if inplace:
            assert torch.equal(work.detach(), leaf.grad), "in-place backward must leave the gradient in the logits"
        else:
            assert not torch.equal(work.detach(), leaf.grad)
        grads[inplace] = leaf.grad
    assert torch.equal(grads[False], grads[True])


@pytest.mark.parametrize("entropy", [False, True])
def test_backward_rows_in_place_on_a_strided_view(entropy):
    """In place over ``storage[:, :4, :V]``: the view gets the gradient, the rest of the storage is untouched."""
    vocab = 2500  # two backward column blocks, the second ragged
    gen = torch.Generator().manual_seed(3)
    storage = torch.randn(2, 5, vocab + 3, generator=gen).to(torch.bfloat16)
    before = storage.clone()
    view = storage[:, :4, :vocab]
    labels = torch.randint(0, vocab, (8,), generator=gen)
    logp, lse, ent = forward_rows(view, labels, 1.0, -100, entropy)
    g_logp, g_ent = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    args = (view, labels, lse, ent, g_logp, g_ent if entropy else None, 1.0, -100)
    expected = backward_rows(*args)
    assert expected.is_contiguous() and expected.data_ptr() != view.data_ptr()
    out = backward_rows(*args, inplace=True)
    assert out.data_ptr() == view.data_ptr()
    assert torch.equal(out, expected)
    outside = torch.ones_like(storage, dtype=torch.bool)
    outside[:, :4, :vocab] = False
    assert torch.equal(storage[outside], before[outside])


def test_in_place_refuses_overlapping_views():
    logits = torch.randn(1, 50).expand(3, 50)
    labels = torch.zeros(3, dtype=torch.int64)
    _, lse, _ = forward_rows(logits, labels, 1.0, -100, False)
    with pytest.raises(ValueError, match="overlap"):
        backward_rows(logits, labels, lse, None, torch.ones(3), None, 1.0, -100, inplace=True)
    assert backward_rows(logits, labels, lse, None, torch.ones(3), None, 1.0, -100).shape == (3, 50)
