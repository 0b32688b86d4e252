"""Every Triton kernel of portarl compiles ahead of time for sm_80 and sm_90, with no spills.

The interpreter (how the rest of the suite runs the kernels) does not catch what only the
compiler rejects, nor register spills. Each module under ``portarl/kernels/`` exports
``AOT_VARIANTS`` (see :data:`portarl.kernels.logprobs.AOT_VARIANTS`); this test compiles
all of them with ``triton.compile`` and a ``GPUTarget`` (no GPU needed: triton ships
ptxas and cuobjdump) and reads registers / stack / local memory of each cubin. The
compiles run in subprocesses (one per target, in parallel) without ``TRITON_INTERPRET``,
which ``make test`` sets for the whole process, and with an empty Triton cache. ``make test``
compiles for sm_90 only, a covering subset of the variants (every pointer dtype set, constexpr
value, launch shape and specialization of each kernel at least once: ``aot_worker.covering``,
about 2.5 minutes of one core instead of 6); ``make test-full`` compiles every variant, and
sm_80 (tests/suite_budget.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

WORKER = Path(__file__).with_name("aot_worker.py")
TARGETS = (80, 90)

_BF16_GRAD = ("logprobs_grad_kernel",
              "*bf16,*i64,i32,*i64,*fp32,*fp32,*fp32,*fp32,*bf16,i32,i32,fp32,i32,constexpr,constexpr,constexpr,constexpr")
#: The stack frames an older Triton's compiler leaves where the pinned one (triton 3.9, its
#: ptxas 12.9) leaves none, each exactly: (target, kernel, signature, constexprs, warps,
#: stages) -> (LOCAL, STACK) bytes. triton 3.6 (the GPU image's; its ptxas 12.8) keeps one
#: loop-invariant integer of the persistent loop (the bf16 grad kernel's reciprocal of
#: n_rows, at 40 registers) in the stack, stored once and reloaded once per loop iteration
#: (read from the SASS, issue 46). Any other spill, or a larger one, still fails; one that is
#: gone passes. (The linear tiles, compiled with the JIT's specialization since, spill on
#: neither triton.)
KNOWN_SPILLS = {
    (3, 6): {
        (80, *_BF16_GRAD, "BLOCK_V=512,IN_PLACE=False,ROUND_BF16=False,WITH_ENTROPY=False", 2, 1): (0, 8),
        (80, *_BF16_GRAD, "BLOCK_V=2048,IN_PLACE=False,ROUND_BF16=False,WITH_ENTROPY=False", 8, 1): (0, 8),
    },
}


def _spill_key(cap, v):
    return (cap, v["kernel"], ",".join(v["signature"].values()),
            ",".join(f"{k}={x}" for k, x in sorted(v["constexprs"].items())), v["num_warps"], v["num_stages"])


def _known_spills() -> dict:
    import triton

    return KNOWN_SPILLS.get(tuple(int(p) for p in triton.__version__.split(".")[:2]), {})


@pytest.fixture(scope="module")
def reports(request, tmp_path_factory):
    """``{target: the worker's report}`` for the targets whose per-target tests run (make test
    leaves sm_80 to make test-full: tests/suite_budget.py)."""
    from suite_budget import running_params

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the JIT's default in triton 3.9, without its warning
    targets = sorted({cap for test in ("test_variants_compile_without_spills", "test_linear_tile_runs_on_tensor_cores",
                                       "test_split_head_runs_on_tensor_cores")
                      for (cap,) in running_params(request, test, ("cap",))}) or [TARGETS[-1]]
    from suite_budget import full_suite

    cover = [] if full_suite(request.config) else ["--cover"]
    procs = {}
    for cap in targets:
        env_cap = dict(env, TRITON_CACHE_DIR=str(tmp_path_factory.mktemp(f"triton-cache-sm{cap}")))
        procs[cap] = subprocess.Popen([sys.executable, str(WORKER), *cover, str(cap)], env=env_cap,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for cap, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1200)
        assert proc.returncode == 0, f"sm_{cap} worker failed:\n{stderr[-4000:]}"
        out[cap] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_every_kernel_module_exports_aot_variants(reports):
    for cap, report in reports.items():
        assert report["modules"], "no kernel modules discovered"
        missing = [m for m, info in report["modules"].items() if info["jit_functions"] and not info["has_aot_variants"]]
        assert not missing, f"kernel modules without AOT_VARIANTS: {missing}"


def test_every_launchable_kernel_has_a_variant(reports):
    """A module's ``*_kernel`` functions (launch targets, not inlined helpers) all appear."""
    report = next(iter(reports.values()))
    compiled = {(v["module"], v["kernel"]) for v in report["variants"]}
    for module, info in report["modules"].items():
        for name in info["jit_functions"]:
            if name.endswith("_kernel"):
                assert (module, name) in compiled, f"{module}.{name} has no AOT variant"


@pytest.mark.parametrize("cap", TARGETS)
def test_variants_compile_without_spills(reports, cap):
    variants = reports[cap]["variants"]
    assert len(variants) >= 50  # logprobs + kl: a variant list that silently emptied would pass otherwise
    errors = [(v["kernel"], v["constexprs"], v["error"]) for v in variants if "error" in v]
    assert not errors, f"sm_{cap}: compile errors: {errors[:3]}"
    known = _known_spills()
    spills = [(v["kernel"], v["constexprs"], v["num_warps"], v["LOCAL"], v["STACK"])
              for v in variants if (v["LOCAL"] or v["STACK"])
              and known.get(_spill_key(cap, v)) != (v["LOCAL"], v["STACK"])]
    assert not spills, f"sm_{cap}: local memory (spills): {spills}"
    assert all(0 < v["REG"] <= 255 for v in variants)


#: linear_tile_kernel dtype pairs (A, B) that must run on the tensor cores: the model dtype's
#: logits tile, and the fp32 gradient tile against a bf16 / fp16 weight (split exactly).
_TENSOR_CORE_PAIRS = {("*bf16", "*bf16"), ("*fp16", "*fp16"), ("*fp32", "*bf16"), ("*fp32", "*fp16")}
#: The instruction each target's tensor-core path compiles to: warpgroup MMA on Hopper, HMMA on Ampere.
_MMA = {90: "HGMMA", 80: "HMMA"}


@pytest.mark.parametrize("cap", TARGETS)
def test_linear_tile_runs_on_tensor_cores(reports, cap):
    """The 16-bit linear tiles' SASS holds tensor-core MMAs (HGMMA for sm_90), so a regression
    to fp32 operands on the FMA path (194 ms instead of eager's 6 ms on an H200) fails here."""
    tiles = [v for v in reports[cap]["variants"] if v["kernel"] == "linear_tile_kernel"
             and (v["signature"]["a_ptr"], v["signature"]["b_ptr"]) in _TENSOR_CORE_PAIRS]
    # 8 launches (bf16, fp16: 2 logits + 2 gradients) x aligned or not; the cover keeps each pair
    assert len(tiles) == 16 if not reports[cap]["cover"] else \
        {(v["signature"]["a_ptr"], v["signature"]["b_ptr"]) for v in tiles} == _TENSOR_CORE_PAIRS, len(tiles)
    slow = [(v["signature"]["a_ptr"], v["signature"]["b_ptr"], v["constexprs"], v["sass"]) for v in tiles
            if v["sass"][_MMA[cap]] == 0]
    assert not slow, f"sm_{cap}: linear tiles without {_MMA[cap]}: {slow}"
    forward = [v for v in tiles if v["signature"]["a_ptr"] == "*bf16" and v["attrs"]]
    assert forward and all(v["sass"][_MMA[cap]] > 0 for v in forward)


@pytest.mark.parametrize("cap", TARGETS)
def test_split_head_runs_on_tensor_cores(reports, cap):
    """The split-vocabulary head's 16-bit tile kernels (forward and gradient, both tiles) hold
    tensor-core MMAs; its fp32 ones stay on the FMA units (the op's exact-products contract)."""
    split = [v for v in reports[cap]["variants"] if v["kernel"] in ("split_forward_kernel", "split_grad_logits_kernel")]
    # 2 kernels x 3 dtypes x 2 tiles x bias x entropy; the cover keeps each kernel's 3 dtypes
    assert len(split) == 48 if not reports[cap]["cover"] else \
        len({(v["kernel"], v["signature"]["h_ptr"]) for v in split}) == 6, len(split)
    sixteen = [v for v in split if v["signature"]["h_ptr"] in ("*bf16", "*fp16")]
    assert sixteen and all(v["sass"][_MMA[cap]] > 0 for v in sixteen), [v["constexprs"] for v in sixteen
                                                                         if not v["sass"][_MMA[cap]]]
    assert all(v["sass"][_MMA[cap]] == 0 for v in split if v["signature"]["h_ptr"] == "*fp32")
