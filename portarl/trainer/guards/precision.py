"""Precision plan: parameter dtype, fp32 master weights, fp16 loss scaling.

- ``fp32``: nothing special.
- ``bf16`` / ``fp16`` parameters (forward, backward, gradients in that dtype): by default
  (``master_weights_fp32: auto``) the optimizer steps fp32 copies (masters) with fp32
  AdamW state, and the updated values are cast back into the parameters after each step
  (the usual mixed-precision recipe; what TRL and verl do). With ``master_weights_fp32:
  false`` the optimizer steps the bf16 parameters themselves, state in bf16: an update
  below half a bf16 ulp of the weight is lost (``update/lost_frac``). Refused for fp16.
- ``fp16`` adds loss scaling (fp16 gradients underflow otherwise): a fixed scale, or a
  dynamic one that halves on overflow (that step is skipped, as an overflow, not a NaN
  failure) and doubles after ``growth_interval`` clean steps.
- Under torchrun (:func:`sharded_plan`) FSDP2's mixed-precision policy keeps the fp32
  parameters and computes in bf16 / fp16, so the plan holds no masters; fp16 keeps its loss
  scale. The overflow decision is rank-consistent by construction: it is read from the
  global gradient norm (a reduction over every rank's shard), so every rank skips the same
  steps and changes the scale the same way. ``torch.amp.GradScaler`` would not be: it
  checks each rank's local shard for inf (``torch/amp/grad_scaler.py``, no collective),
  which is why FSDP1 has ``ShardedGradScaler`` (an all-reduce of ``found_inf``).
"""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionPlan:
    def __init__(self, model: torch.nn.Module, dtype: str, master_weights_fp32: bool, loss_scale,
                 growth_interval: int = 200):
        self.dtype = DTYPES[dtype]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.use_master = master_weights_fp32 and self.dtype != torch.float32
        self.masters = [p.detach().clone().float().requires_grad_(True) for p in self.params] if self.use_master else None
        self.dynamic = self.dtype == torch.float16 and loss_scale == "dynamic"
        if self.dtype != torch.float16 or loss_scale is None:
            self.scale = 1.0
        else:
            self.scale = 2.0**16 if loss_scale == "dynamic" else float(loss_scale)
        self.growth_interval = growth_interval
        self._clean_steps = 0

    @property
    def lossy(self) -> bool:
        """The optimizer steps low-precision parameters directly (no fp32 masters)."""
        return self.dtype != torch.float32 and not self.use_master

    def optimizer_params(self) -> list[torch.Tensor]:
        return self.masters if self.use_master else self.params

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scale != 1.0 else loss

    def unscale_grads(self) -> None:
        """Gradients in the optimizer's tensors, divided by the loss scale, in fp32 for masters."""
        inv = 1.0 / self.scale
        targets = self.optimizer_params()
        for p, t in zip(self.params, targets):
            if p.grad is None:
                t.grad = None
                continue
            g = p.grad.float() * inv if (self.use_master or inv != 1.0) else p.grad
            if self.use_master:
                t.grad = g
            elif inv != 1.0:
                p.grad.copy_(g)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.masters is not None:
            for m in self.masters:
                m.grad = None

    @torch.no_grad()
    def after_step(self) -> None:
        if self.use_master:
            for p, m in zip(self.params, self.masters):
                p.copy_(m.to(p.dtype))

    def update_scale(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale = max(self.scale / 2.0, 1.0)
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps % self.growth_interval == 0:
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale, "clean_steps": self._clean_steps,
            "masters": [m.detach().clone() for m in self.masters] if self.masters is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = state["scale"], state["clean_steps"]
        if self.masters is not None and state["masters"] is not None:
            with torch.no_grad():
                for m, saved in zip(self.masters, state["masters"]):
                    m.copy_(saved)


def sharded_plan(model: torch.nn.Module, dtype: str, loss_scale, growth_interval: int = 200) -> PrecisionPlan:
    """The plan under FSDP2: parameters are fp32 shards (no masters here); ``fp16`` keeps
    its loss scale, fixed or dynamic, exactly as on one process."""
    plan = PrecisionPlan(model, "fp32", False, None, growth_interval)
    if dtype == "fp16" and loss_scale is not None:
        plan.dynamic = loss_scale == "dynamic"
        plan.scale = 2.0**16 if plan.dynamic else float(loss_scale)
    return plan
