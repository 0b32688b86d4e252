"""Process-wide numerics switches: read, held to the trainer's policy, and recorded.

A colocated rollout engine shares the trainer's process, and vllm-ascend (v0.23) changes
two switches for the whole process when it starts (read in its wheel):
``vllm_ascend/worker/model_runner_v1.py`` sets ``torch.npu.config.allow_internal_format =
True`` at import (the NZ weight format: the trainer's own matmuls may then take it, with
other rounding), and ``vllm_ascend/batch_invariant.py`` calls
``torch.use_deterministic_algorithms(True, warn_only=True)`` when batch invariance is on.
:func:`held` reads the switches before the engine starts (the trainer's policy), puts back
any the engine changed, logs each one and keeps a record, which
:func:`portarl.backends.envinfo.environment` writes into the run's environment record (the stability
harness's ``run.json`` and report, parity and benchmark reports).

Switches (:func:`read`): ``deterministic_algorithms`` and ``deterministic_warn_only`` on
every device, and on an NPU torch_npu's ``npu.allow_internal_format``,
``npu.matmul.allow_hf32`` and ``npu.conv.allow_hf32``
(:data:`portarl.backends.npu.torch_npu_api.PRECISION_OPTIONS`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

log = logging.getLogger("portarl.precision")

#: Every switch an engine changed and portarl put back, in this process:
#: ``{"switch", "changed_to", "restored_to", "by"}``.
_restored: list[dict] = []


def read(device_type: str) -> dict[str, bool]:
    """This process's switches that matter on ``device_type``."""
    out = {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
           "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled()}
    if device_type == "npu":
        from portarl.backends.npu import torch_npu_api

        out.update(torch_npu_api.precision_switches())
    return out


def _apply(policy: dict[str, bool], names: set[str]) -> None:
    if names & {"deterministic_algorithms", "deterministic_warn_only"}:
        torch.use_deterministic_algorithms(policy["deterministic_algorithms"],
                                           warn_only=policy["deterministic_warn_only"])
    npu = names - {"deterministic_algorithms", "deterministic_warn_only"}
    if npu:
        from portarl.backends.npu import torch_npu_api

        for name in sorted(npu):
            torch_npu_api.set_precision_switch(name, policy[name])


def restore(policy: dict[str, bool], device_type: str, by: str) -> list[dict]:
    """Put back every switch of ``policy`` that differs now; log and record each one."""
    now = read(device_type)
    changed = {name for name, value in policy.items() if now.get(name) != value}
    if not changed:
        return []
    _apply(policy, changed)
    entries = [{"switch": name, "changed_to": now.get(name), "restored_to": policy[name], "by": by}
               for name in sorted(changed)]
    for entry in entries:
        log.warning("%s set %s=%s for the whole process; set back to the trainer's %s", by, entry["switch"],
                    entry["changed_to"], entry["restored_to"])
    _restored.extend(entries)
    return entries


@contextlib.contextmanager
def held(device_type: str, by: str) -> Iterator[dict[str, bool]]:
    """Run the block (an engine's start), then put back the switches it changed."""
    policy = read(device_type)
    try:
        yield policy
    finally:
        restore(policy, device_type, by)


def restored() -> list[dict]:
    """What :func:`restore` put back in this process so far (for the environment record)."""
    return [dict(entry) for entry in _restored]
