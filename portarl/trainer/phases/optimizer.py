"""AdamW as one kernel (fused) or one op per tensor list (foreach) instead of a Python loop
over the parameters (``optim.implementation``).

torch's default AdamW loops over the parameters in Python (``single``), a handful of small
kernels each; ``foreach`` runs each arithmetic op once over the whole tensor list, and
``fused`` runs the whole update as one kernel per dtype and device. They compute the same
update (equal within fp32 rounding; ``tests/trainer/test_optimizer_impl.py``).

``auto`` picks ``fused`` on CUDA and on the CPU (torch's CPU kernel: 0.25 ms against
foreach's 0.8 ms per step for the 26 tensors of ``portarl bench step``'s model, where
foreach is still a loop over tensors) and ``foreach`` elsewhere. On Ascend NPUs ``fused``
is ``torch.optim.AdamW(fused=True)`` on torch_npu's ``_fused_adamw_`` kernel: torch lists
the npu (privateuse1) backend among the fused devices, and torch-npu 2.13.0 / 2.10.0.post4
register the op in their shipped schemas (read from the wheels); it is allowed where the
running torch_npu registered the kernel and refused with the reason otherwise
(:func:`portarl.backends.npu.torch_npu_api.fused_adamw_reason`). ``auto`` stays
``foreach`` on the NPU until fused is measured there (docs/hardware-ci.md).
(torch itself defaults to foreach on CUDA and to the per-parameter loop on CPU.) fp32
master weights are ordinary fp32 tensors; FSDP2's DTensor parameters take foreach under
``auto``.

Checkpoints: the optimizer state is the same in every implementation except where
``state["step"]`` lives (the device for ``fused``, the host otherwise), and
``load_state_dict`` would also bring back the *saved* run's ``foreach`` / ``fused``
flags. A post-load hook puts back the configured implementation and moves ``step`` where
it needs to be, so a checkpoint written with one implementation resumes in any other.
"""

from __future__ import annotations

import torch

from portarl.runtime.distributed import has_sharded_params

IMPLEMENTATIONS = ("auto", "fused", "foreach", "single")


def resolve_implementation(name: str, device: torch.device, sharded: bool = False) -> str:
    """``fused`` / ``foreach`` / ``single`` for ``optim.implementation=name`` on ``device``
    (``sharded``: FSDP2 DTensor parameters)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"optim.implementation={name!r} must be one of {', '.join(IMPLEMENTATIONS)}")
    if name == "auto":
        return "fused" if device.type in ("cuda", "cpu") and not sharded else "foreach"
    if name == "fused" and device.type == "npu":
        from portarl.backends.npu import torch_npu_api

        reason = torch_npu_api.fused_adamw_reason()
        if reason is not None:
            raise ValueError(f"optim.implementation=fused: {reason}; use optim.implementation=auto or foreach")
    elif name == "fused":
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        if device.type not in _get_fused_kernels_supported_devices():
            raise ValueError(f"optim.implementation=fused: torch has no fused AdamW for device {device.type!r}; "
                             "use optim.implementation=auto or foreach")
    return name


def _flags(impl: str) -> dict:
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


def make_adamw(params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
               implementation: str = "auto") -> torch.optim.AdamW:
    """AdamW over ``params`` in the resolved implementation (``optimizer.portarl_impl``);
    its ``load_state_dict`` accepts a state saved by any implementation."""
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    impl = resolve_implementation(implementation, device, sharded=has_sharded_params(params))
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **_flags(impl))
    optimizer.portarl_impl = impl
    optimizer.register_load_state_dict_post_hook(_keep_implementation)
    return optimizer


def _keep_implementation(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: this run's implementation flags (not the saved run's), and
    ``step`` where that implementation reads it (fp32 on the parameter's device for fused,
    on the host otherwise: the single and foreach paths read it there without a sync)."""
    impl = getattr(optimizer, "portarl_impl", None)
    if impl is None:
        return
    for group in optimizer.param_groups:
        group.update(_flags(impl))
        capturable = group.get("capturable", False)
        for p in group["params"]:
            state = optimizer.state.get(p)
            step = None if not state else state.get("step")
            if not torch.is_tensor(step):
                continue
            if impl == "fused" or capturable:
                state["step"] = step.to(dtype=torch.float32, device=p.device)
            elif step.device.type != "cpu":
                state["step"] = step.detach().to("cpu", torch.float32)
