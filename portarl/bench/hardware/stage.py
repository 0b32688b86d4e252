"""One stage of ``portarl hardware-check`` in a process of its own:
``python -m portarl.bench.hardware.stage NAME PLAN_JSON OUT WORK``.

Writes ``WORK/NAME.result.json`` (status, one line, details) when the stage returns, also
when it raised: the exception becomes the stage's failure line, its traceback goes to the
log. A process that dies leaves no result, and :func:`portarl.bench.hardware.check.run_stage`
reports its exit instead.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path


def main(argv: list[str]) -> int:
    name, plan_path, out, work = argv
    plan_data = json.loads(Path(plan_path).read_text())
    if plan_data["device"].split(":")[0] == "cpu":
        # Triton kernels on a CPU run under the interpreter, chosen before portarl's kernels import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from portarl.backends.device import resolve_device
    from portarl.bench.hardware.check import STAGE_MODULES, write_json
    from portarl.bench.hardware.plan import CheckPlan

    plan = CheckPlan.from_json(plan_path)
    out, work = Path(out), Path(work)

    def log(line: str) -> None:
        print(line, flush=True)

    result_path = work / f"{name}.result.json"
    try:
        device = resolve_device(plan.device)
        module_name, function = STAGE_MODULES[name]
        result = getattr(importlib.import_module(module_name), function)(plan, device, out, work, log)
    except Exception as err:  # the stage failed: named in the summary, the traceback in the log
        traceback.print_exc()
        result = {"status": "failed", "line": f"{type(err).__name__}: {str(err)[:300]}"}
    write_json(result_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
