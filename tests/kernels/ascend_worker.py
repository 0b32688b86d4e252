"""Compile every Triton kernel variant of portarl for an Ascend NPU with triton-ascend, on a
machine without CANN or an NPU (``make check-triton-ascend``; its own virtual environment,
because triton-ascend installs as the ``triton`` package in place of upstream triton).

    .venv-triton-ascend/bin/python tests/kernels/ascend_worker.py [--json]

The variants are the ones the sm_80 / sm_90 ahead-of-time compile builds
(:func:`aot_worker.kernel_modules`, each module's ``AOT_VARIANTS``). triton-ascend lowers a
kernel Triton IR -> TTIR -> linalg (``ttadapter``, its ``triton-adapter-opt``) -> ``npubin``;
only the last stage needs CANN's bishengir compiler. A variant passes when it compiles, or
when the only error is that last stage's (``ConvertLinalgRToBinary``: CANN absent), so it
went through the linalg stage; any other error (a construct triton-ascend cannot lower)
fails the check. Exit status 1 when a variant fails, naming it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: The stage after linalg, in the message triton-ascend raises without CANN.
AFTER_LINALG = "[ConvertLinalgRToBinary]"
#: An A2 training part (Atlas 800T A2); any Ascend910B name selects the same lowering.
TARGET_ARCH = "Ascend910B3"


def outcome(error: BaseException | None) -> str:
    """``"npubin"`` (compiled: CANN present), ``"linalg"`` (stopped where CANN is needed) or
    ``"failed"``."""
    if error is None:
        return "npubin"
    return "linalg" if AFTER_LINALG in str(error) else "failed"


def compile_variant(variant: dict, target) -> dict:
    import triton
    from triton.compiler import ASTSource

    kernel = variant["kernel"]
    entry = {"kernel": kernel.__name__, "constexprs": variant["constexprs"]}
    start = time.perf_counter()
    error = None
    try:
        # triton-ascend 3.2's ASTSource takes ``constants=`` (upstream's later ``constexprs=``).
        src = ASTSource(fn=kernel, signature=variant["signature"], constants=variant["constexprs"])
        triton.compile(src, target=target, options={"num_warps": variant["num_warps"],
                                                    "num_stages": variant["num_stages"]})
    except Exception as err:  # classified below; a failure is reported, and fails the check
        error = err
    entry["stage"] = outcome(error)
    if entry["stage"] == "failed":
        entry["error"] = f"{type(error).__name__}: {error}"[:2000]
    entry["seconds"] = round(time.perf_counter() - start, 3)
    return entry


def main() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    from aot_worker import kernel_modules

    target = GPUTarget("npu", TARGET_ARCH, 0)
    report = {"triton": triton.__version__, "target": TARGET_ARCH, "variants": []}
    for module in kernel_modules():
        for variant in getattr(module, "AOT_VARIANTS", []):
            report["variants"].append({"module": module.__name__, **compile_variant(variant, target)})
    return report


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    result = main()
    failed = [v for v in result["variants"] if v["stage"] == "failed"]
    if "--json" in sys.argv[1:]:
        print(json.dumps(result))
    stages = sorted({v["stage"] for v in result["variants"]})
    print(f"triton-ascend {result['triton']} ({result['target']}): {len(result['variants'])} kernel variants, "
          f"{len(failed)} failed; stages reached: {', '.join(stages) or '-'}", file=sys.stderr)
    for v in failed:
        print(f"FAILED {v['module']}.{v['kernel']} {v['constexprs']}: {v['error']}", file=sys.stderr)
    sys.exit(1 if failed or not result["variants"] else 0)
