"""Compile every Triton kernel variant of portarl ahead of time for one GPU target.

    python tests/kernels/aot_worker.py 90      # sm_90; prints one JSON document
    python tests/kernels/aot_worker.py --cover 90   # a covering subset (make test: see covering())
    python tests/kernels/aot_worker.py --markdown 80 90 > bench/results/aot-kernels.md

Run by tests/kernels/test_aot_compile.py in a subprocess without ``TRITON_INTERPRET``
(under the interpreter ``@triton.jit`` builds interpreted functions that cannot be
compiled) and with a fresh ``TRITON_CACHE_DIR``. Needs no GPU: triton ships ptxas and
cuobjdump. For each variant: registers, stack and local memory (spills) from
``cuobjdump --dump-resource-usage`` of the cubin.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time


def kernel_modules():
    import portarl.kernels

    for info in pkgutil.iter_modules(portarl.kernels.__path__):
        yield importlib.import_module(f"portarl.kernels.{info.name}")


def jit_functions(module):
    from triton.runtime.jit import JITFunction

    return [v for v in vars(module).values() if isinstance(v, JITFunction) and v.__module__ == module.__name__]


def cuobjdump(cubin: bytes, flag: str) -> str:
    """triton's bundled ``cuobjdump FLAG`` on a cubin, its stdout."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> dict:
    text = cuobjdump(cubin, "--dump-resource-usage")
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", text)}
    if "REG" not in usage:
        raise RuntimeError(f"no resource usage in cuobjdump output:\n{text}")
    return usage


#: SASS instructions counted per variant: tensor-core MMAs (Hopper's warpgroup HGMMA, the
#: warp-level HMMA of sm_80 and up) and the fp32 FMA the non-tensor-core path runs on.
SASS_OPS = ("HGMMA", "HMMA", "FFMA")


def sass_counts(cubin: bytes) -> dict:
    text = cuobjdump(cubin, "-sass")
    return {op: len(re.findall(rf"\b{op}\b", text)) for op in SASS_OPS}


def _features(kernel_name: str, variant: dict) -> set:
    """What one variant exercises: its pointer dtypes, each constexpr flag's value, its warps
    and stages, its specialization."""
    sig = variant["signature"]
    found = {("pointers", ",".join(t for t in sig.values() if t.startswith("*"))),
             ("launch", variant["num_warps"], variant["num_stages"]), ("attrs", tuple(sorted(variant.get("attrs", {}))))}
    found |= {("flag", k, str(x)) for k, x in variant["constexprs"].items() if sig.get(k) == "constexpr"}
    return {(kernel_name, *f) for f in found}


def covering(variants: list) -> list:
    """The variants, in order, that each add something no earlier one exercised (a pointer
    dtype set, a constexpr value, a launch shape, a specialization) for their kernel: about
    2/5 of the variants and of the compile time, every value of every axis compiled at least
    once. ``make test`` compiles these; ``make test-full`` and the GPU check compile all."""
    seen, kept = set(), []
    for variant in variants:
        new = _features(variant["kernel"].__name__, variant) - seen
        if new:
            kept.append(variant)
            seen |= new
    return kept


def main(capability: int, cover: bool = False) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    report = {"target": f"sm_{capability}", "modules": {}, "variants": [], "cover": cover}
    for module in kernel_modules():
        kernels = jit_functions(module)
        report["modules"][module.__name__] = {
            "jit_functions": [k.__name__ for k in kernels],
            "has_aot_variants": hasattr(module, "AOT_VARIANTS"),
        }
        variants = list(getattr(module, "AOT_VARIANTS", []))
        for variant in covering(variants) if cover else variants:
            kernel = variant["kernel"]
            entry = {"module": module.__name__, "kernel": kernel.__name__, "constexprs": variant["constexprs"],
                     "attrs": sorted(variant.get("attrs", {})),
                     "signature": variant["signature"], "num_warps": variant["num_warps"],
                     "num_stages": variant["num_stages"]}
            start = time.perf_counter()
            try:
                # "attrs": {argument: "D"}, the JIT's 16-divisibility specialization of that argument
                attrs = {(kernel.arg_names.index(k),): [["tt.divisibility", 16]] for k in variant.get("attrs", {})}
                src = ASTSource(fn=kernel, signature=variant["signature"], constexprs=variant["constexprs"],
                                attrs=attrs)
                compiled = triton.compile(src, target=target, options={"num_warps": variant["num_warps"],
                                                                       "num_stages": variant["num_stages"]})
                entry.update(resource_usage(compiled.asm["cubin"]))
                entry["sass"] = sass_counts(compiled.asm["cubin"])
            except Exception as err:  # reported, and failed, by the test
                entry["error"] = f"{type(err).__name__}: {err}"[:2000]
            entry["seconds"] = round(time.perf_counter() - start, 3)
            report["variants"].append(entry)
    return report


def markdown(reports: list) -> str:
    targets = [r["target"] for r in reports]
    lines = ["# Triton kernels compiled ahead of time", "",
             "Command: `env -u TRITON_INTERPRET python tests/kernels/aot_worker.py --markdown "
             + " ".join(t[3:] for t in targets) + " > bench/results/aot-kernels.md`", "",
             "Registers per thread, and local memory / stack bytes (spills; 0 required by "
             "tests/kernels/test_aot_compile.py), from `cuobjdump --dump-resource-usage`; MMA: the "
             "tensor-core instructions in the SASS (`cuobjdump -sass`: HGMMA on sm_90, HMMA), 0 for "
             "kernels without a matrix product or on the FMA path. Specialized: the arguments the JIT "
             "makes constants (a stride of 1) or marks 16-divisible.", "",
             "| kernel | constexprs | signature (pointers) | specialized | warps | stages | "
             + " | ".join(f"REG {t} | LOCAL+STACK {t} | MMA {t}" for t in targets) + " |",
             "|---|---|---|---|---|---|" + "---|---|---|" * len(targets)]
    for rows in zip(*(r["variants"] for r in reports)):
        v = rows[0]
        flags = ", ".join(f"{k}={x}" for k, x in v["constexprs"].items() if v["signature"].get(k) == "constexpr"
                          and not k.startswith("stride_"))
        pointers = ",".join(t for t in v["signature"].values() if t.startswith("*"))
        units = [f"{k}=1" for k in v["constexprs"] if k.startswith("stride_")]
        special = ", ".join(units + (["16-divisible"] if v.get("attrs") else [])) or "-"
        cells = " | ".join(f"{r.get('REG', 'error')} | {r.get('LOCAL', 0) + r.get('STACK', 0)} | "
                           f"{max(r.get('sass', {}).get('HGMMA', 0), r.get('sass', {}).get('HMMA', 0))}" for r in rows)
        lines.append(f"| {v['kernel']} | {flags} | {pointers} | {special} | {v['num_warps']} | {v['num_stages']} | "
                     f"{cells} |")
    regs = [r.get("REG", 0) for rep in reports for r in rep["variants"]]
    lines += ["", f"{len(reports[0]['variants'])} variants per target; registers {min(regs)}-{max(regs)}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    args = sys.argv[1:]
    if args and args[0] == "--markdown":
        print(markdown([main(int(c)) for c in args[1:]]), end="")
    elif args and args[0] == "--cover":
        print(json.dumps(main(int(args[1]), cover=True)))
    else:
        print(json.dumps(main(int(args[0]))))
