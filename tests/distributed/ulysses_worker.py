"""Worker of tests/distributed/test_ulysses.py, under torchrun over Gloo (N ranks):
Ulysses sequence parallelism (:mod:`portarl.trainer.phases.ulysses`) against the whole
sequence in one process.

Every rank builds the same tiny Qwen2 (4 query heads, 2 key / value heads: at SP 4 each
key / value head is repeated) and the same rows; a plain copy scores them whole
(``completion_logprobs`` without ``sp``), the reference. Then, for each SP size given that
divides N, the rows are scored sequence-parallel and a loss of log-probs and entropy is
backpropagated:

- plain models: each rank's parameter gradients, summed over its SP group, must equal the
  reference's;
- FSDP2 (the trainer's path, the head passed through): the loss times the world size,
  and the ``full_tensor`` of the gradients (FSDP2's average over every rank) must equal
  the reference's.

Layouts: padded rows (left-padded prompts), padding-free rows where one sequence ends
exactly on a shard boundary, rows whose length SP does not divide (padded to a multiple),
shared-prompt rows (one prompt, several completions, whose first tokens are all scored
from the prompt's last position), and padding-free rows over the dense mask bound (causal
rows: the whole rows' mask must be None). Each but the shared-prompt rows also under flash
varlen attention (fp32): the stand-in of tests/varlen_standin.py gets the rows' spans, in
every layer. Tolerances from :mod:`portarl.parity.tolerances` (fp32, and bf16 for a bf16
model; bf16 gradients against float64, :func:`low_precision_path`). Then the negative check: a model whose attention does not go through the wrapper
(eager) must raise, not silently score the shards alone. Prints one ``ok`` line per case.

    torchrun --nproc-per-node N ulysses_worker.py SIZES DTYPES OUT_DIR

Rank 0 saves every case's gradients compared (the whole sequence's and SP's) to
``OUT_DIR/gradients.safetensors`` (keys ``<case>/whole/<param>``, ``<case>/sp/<param>``) and
the cases' labels to ``OUT_DIR/cases.json``: the test holds them to tests/run_guard.py's
:func:`assert_gradient_flows` (gradients that are all 0 would agree in every layout).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))  # tests/: varlen_standin
from varlen_standin import varlen_standin  # noqa: E402

from portarl import ops
from portarl.parity.tolerances import fp32_result, low_precision_forward, low_precision_path
from portarl.runtime import distributed as pdist
from portarl.runtime.sequence_parallel import make_group
from portarl.trainer.phases.packing import Layout, pack_micro_batch
from portarl.trainer.phases.sequences import build_batch, completion_logprobs
from portarl.trainer.phases import attention_masks as masks
from portarl.trainer.phases import ulysses
from portarl.trainer.phases.ulysses import install_attention, sp_completion_logprobs

TEMPERATURE = 0.8
#: Prompt / completion lengths: a padding-free row [12] and a row [6, 6] whose boundary falls on
#: the shard boundary at SP 2 and 4 (width 12); a second set of width 13, which no SP divides.
SHAPES = {
    "boundary": ([4, 3, 2], [8, 3, 4]),
    "odd": ([5, 3, 2], [8, 3, 4]),
}


def _model(dtype):
    from portarl.assets.models import build_tiny

    model, _ = build_tiny(seed=3, hidden_size=32, intermediate_size=64)
    return model.to(dtype)


def _batch(name: str, layout: str):
    gen = torch.Generator().manual_seed(len(name))
    prompts_len, completions_len = SHAPES[name]
    prompts = [torch.randint(3, 40, (p,), generator=gen).tolist() for p in prompts_len]
    completions = [torch.randint(3, 40, (c,), generator=gen).tolist() for c in completions_len]
    if layout == "shared":  # one group: the same prompt, held once, under the rows' own 4-D mask
        prompts = [prompts[0]] * len(prompts)
        prompts_len = [len(prompts[0])] * len(prompts)
    batch = build_batch(prompts, completions, 0, "cpu")
    if layout == "packed":  # rows as long as the longest sequence: [first] and [second, third]
        batch.packed = pack_micro_batch(batch, prompts_len, completions_len, Layout("rows", longest_only=True))
    if layout == "causal":  # padding-free rows over the dense mask bound: one sequence per row, no mask
        bound, masks.DENSE_MASK_BOUND_BYTES = masks.DENSE_MASK_BOUND_BYTES, 0
        try:
            batch.packed = pack_micro_batch(batch, prompts_len, completions_len, Layout("rows", impl="sdpa"))
        finally:
            masks.DENSE_MASK_BOUND_BYTES = bound
        assert batch.packed.input_ids.shape[0] == len(prompts), "causal rows: one sequence per row"
    if layout == "shared":
        shared = Layout("rows", linear=10**6, attention=1, share_prompt=True)
        batch.packed = pack_micro_batch(batch, prompts_len, completions_len, shared, [tuple(p) for p in prompts])
        assert batch.packed.attention_mask is not None, "the rows must share their prompt"
    return batch


@contextlib.contextmanager
def _masks_seen():
    """The masks the SP forwards inside build for their whole rows (None: plain causal)."""
    seen: list = []
    original = ulysses.row_mask

    def recording(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    ulysses.row_mask = recording
    try:
        yield seen
    finally:
        ulysses.row_mask = original


def _loss(batch, logp, entropy):
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(batch.labels.shape, generator=gen)
    b = torch.randn(batch.labels.shape, generator=gen)
    return ((a * logp + 0.1 * b * entropy) * batch.mask).sum()


def _score(model, batch, sp=None):
    if sp is None:
        return completion_logprobs(model, batch, temperature=TEMPERATURE, with_entropy=True)
    return sp_completion_logprobs(model, batch, sp, temperature=TEMPERATURE, with_entropy=True)


def _float64_linear_logprobs(hidden, weight, labels, *, bias=None, temperature=1.0, return_entropy=False, **kw):
    """``ops.linear_logprobs`` for float64 inputs, differentiable (the ops take no float64):
    the exact reference of a low-precision model's gradients."""
    if hidden.dtype != torch.float64:
        return _LINEAR_LOGPROBS(hidden, weight, labels, bias=bias, temperature=temperature,
                                return_entropy=return_entropy, **kw)
    log_sm = torch.log_softmax((hidden @ weight.T + (0.0 if bias is None else bias)) / temperature, dim=-1)
    valid = labels != -100
    logp = torch.where(valid, log_sm.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1), 0.0)
    entropy = torch.where(valid, -(log_sm.exp() * log_sm).sum(-1), 0.0)
    return (logp, entropy) if return_entropy else logp


_LINEAR_LOGPROBS = ops.linear_logprobs
ops.linear_logprobs = _float64_linear_logprobs


def _grads(model) -> dict:
    return {n: pdist.full(p.grad).detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _sp_step(base, batch, sp, impl: str | None = None):
    """``(masks seen, logp, entropy, gradients summed over the SP group)`` of a copy of
    ``base`` (its attention set to ``impl`` if given) scoring ``batch`` sequence-parallel."""
    model = copy.deepcopy(base)
    if impl is not None:
        model.config._attn_implementation = impl
    with _masks_seen() as seen:
        logp, entropy = _score(model, batch, sp)
    _loss(batch, logp, entropy).backward()
    grads = _grads(model)
    for g in grads.values():
        dist.all_reduce(g, group=sp.group)
    return seen, logp, entropy, grads


def _check(name: str, got: torch.Tensor, want: torch.Tensor, tol) -> float:
    diff = (got.float() - want.float()).abs()
    bad = diff > tol.allowed(want.float())
    if bool(bad.any()):
        raise AssertionError(f"{name}: max |diff| {float(diff.max()):.3g} over the tolerance "
                             f"(atol {tol.atol:.3g}, rtol {tol.rtol:.3g})")
    return float(diff.max())


#: (case label, the whole sequence's gradients, SP's) of every case compared, on rank 0 (saved by main).
COMPARED: list[tuple[str, dict, dict]] = []


def _compare(label: str, dtype, logp, entropy, grads, ref_logp, ref_entropy, ref_grads, scale: float,
             exact_grads: dict | None = None) -> None:
    if dist.get_rank() == 0:
        COMPARED.append((label, ref_grads, grads))
    tol = fp32_result(scale) if dtype == torch.float32 else low_precision_forward(scale, dtype)
    worst = [_check(f"{label} logp", logp, ref_logp, tol), _check(f"{label} entropy", entropy, ref_entropy, tol)]
    assert grads.keys() == ref_grads.keys() and grads, (label, sorted(grads), sorted(ref_grads))
    for key, ref in ref_grads.items():
        if dtype != torch.float32:
            # bf16 parameters get bf16 gradients, each a sum rounded in bf16 at every step of
            # another order: both paths are held to the float64 gradient of the same
            # parameters, SP's error at most LOW_PRECISION_PATH_ERROR_RATIO x the whole row's.
            exact = exact_grads[key]
            tol_g = low_precision_path(float((ref - exact).abs().max()), float(exact.abs().max()))
            _check(f"{label} grad {key} (vs float64)", grads[key].double(), exact, tol_g)
            worst.append(float((grads[key] - ref).abs().max()))
            continue
        # The fp32 op's error (fp32_result) relative to the gradient's own scale.
        tol_g = type(tol)(atol=tol.atol * (float(ref.abs().max()) + 1.0), rtol=0.0)
        worst.append(_check(f"{label} grad {key}", grads[key], ref, tol_g))
    if dist.get_rank() == 0:
        print(f"ok {label}: max |diff| {max(worst):.3g}", flush=True)


def run(sizes: list[int], dtypes: list[torch.dtype]) -> None:
    world = dist.get_world_size()
    ctx = pdist.DistContext(dist.get_rank(), world, 0, "gloo")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    varlen_calls: list[int] = []  # flash varlen: the stand-in (tests/varlen_standin.py), then SP's wrapper
    ALL_ATTENTION_FUNCTIONS.register("flash_attention_2", varlen_standin(varlen_calls, check_positions=False))
    install_attention()
    for dtype in dtypes:
        base = _model(dtype)
        for layout in ("padded", "packed", "shared", "causal"):
            for shape in SHAPES:
                batch = _batch(shape, layout)
                ref_model = copy.deepcopy(base)
                ref_logp, ref_entropy = _score(ref_model, batch)
                _loss(batch, ref_logp, ref_entropy).backward()
                ref_grads = _grads(ref_model)
                exact_grads = None
                if dtype != torch.float32:  # the same parameters' exact gradients
                    exact_model = copy.deepcopy(base).double()
                    _loss(batch, *_score(exact_model, batch)).backward()
                    exact_grads = {k: v.double() for k, v in _grads(exact_model).items()}
                hidden_scale = 1.0 + float(ref_entropy.detach().abs().max())
                for size in sizes:
                    sp = make_group(ctx, size)
                    seen, logp, entropy, grads = _sp_step(base, batch, sp)
                    if layout == "causal":  # the whole rows' attention holds no [W, W] mask either
                        assert seen == [None], seen
                    _compare(f"{dtype} {layout} {shape} SP {size} of {world}", dtype, logp, entropy, grads,
                             ref_logp, ref_entropy, ref_grads, hidden_scale, exact_grads)
                    if dtype != torch.float32 or layout == "shared":  # flash: no shared-prompt rows
                        continue
                    del varlen_calls[:]
                    _, logp, entropy, grads = _sp_step(base, batch, sp, "flash_attention_2")
                    # one call per layer (no activation checkpointing: no recomputation), each with the rows' spans
                    assert len(varlen_calls) == base.config.num_hidden_layers and min(varlen_calls) >= 2, varlen_calls
                    _compare(f"{dtype} {layout} {shape} varlen SP {size} of {world}", dtype, logp, entropy, grads,
                             ref_logp, ref_entropy, ref_grads, hidden_scale)
    # FSDP2, the trainer's path: fp32, SP = every rank, packed rows on the shard boundary
    batch = _batch("boundary", "packed")
    ref_model = _model(torch.float32)
    ref_logp, ref_entropy = _score(ref_model, batch)
    _loss(batch, ref_logp, ref_entropy).backward()
    sharded = pdist.shard(_model(torch.float32))
    sp = make_group(ctx, world)
    logp, entropy = _score(sharded, batch, sp)
    (_loss(batch, logp, entropy) * world).backward()
    _compare(f"fsdp2 SP {world}", torch.float32, logp, entropy, _grads(sharded), ref_logp, ref_entropy,
             _grads(ref_model), 1.0 + float(ref_entropy.detach().abs().max()))
    # Never a silent no-op: attention that bypasses the wrapper (eager) must raise
    eager = _model(torch.float32)
    eager.set_attn_implementation("eager")
    try:
        _score(eager, batch, sp)
    except RuntimeError as err:
        assert "not split" in str(err) or "all-to-all" in str(err), err
        if dist.get_rank() == 0:
            print(f"ok refused unwrapped attention: {err}", flush=True)
    else:
        raise AssertionError("a model whose attention bypasses the all-to-all scored without an error")


def save_compared(out: str) -> None:
    """Rank 0: the gradients of every case compared, for the test's guard (module docstring)."""
    from safetensors.torch import save_file

    tensors = {f"{i}/{side}/{name}": g.detach().clone() for i, (_, whole, sp) in enumerate(COMPARED)
               for side, grads in (("whole", whole), ("sp", sp)) for name, g in grads.items()}
    save_file(tensors, os.path.join(out, "gradients.safetensors"))
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump([label for label, _, _ in COMPARED], f)


def main(argv: list[str]) -> int:
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    try:
        sizes = [int(s) for s in argv[0].split(",")]
        dtypes = [getattr(torch, d) for d in argv[1].split(",")]
        run(sizes, dtypes)
        if dist.get_rank() == 0:
            save_compared(argv[2])
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
