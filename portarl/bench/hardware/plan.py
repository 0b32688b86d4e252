"""What ``portarl hardware-check`` runs on a device, and how long each stage may take.

One plan per (device type, quick). The full plan is sized so that the whole check ends in
at most 8 minutes on one H100 (the lent machine's 15 minutes of device time include its
start and a possible second try); ``--quick`` runs every stage on small shapes (CI runs it
on the CPU so that the command cannot rot between loans). A stage that runs past its limit
is stopped and named in the summary with what it finished (the kernel table and the parity
report are written as they grow), and the check exits non-zero.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

#: Stage names, in the order they run.
STAGES = ("environment", "parity", "kernels", "training", "step", "hardware-tests")

#: Log-prob / KL shapes (N rows x V vocabulary) timed on an accelerator: Qwen2.5's vocabulary
#: at 4,096 tokens and Llama-3's at 8,192 (the issue's RL shapes).
RL_LOGPROB_SHAPES = ((4096, 151936), (8192, 128256))
#: The fused linear log-probs (N x H x V): Qwen2.5-0.5B's head at 4,096 tokens and Llama-3-8B's
#: at 8,192.
RL_LINEAR_SHAPES = ((4096, 896, 151936), (8192, 4096, 128256))

#: Settings every training run of the check shares: the features a real run switches on.
#: (The attention implementation is chosen by what the device has: :func:`attention_for`.)
TRAINING_FEATURES = (
    "train.gradient_checkpointing=true",  # activation checkpointing per decoder layer
    "train.padding_free=true",  # padding-free rows (refused where the attention cannot)
    "optim.implementation=fused",  # fused AdamW
)


@dataclasses.dataclass
class CheckPlan:
    device: str  # "cuda", "npu", "cpu" (or "cuda:1")
    quick: bool = False
    #: Seconds each stage may take (a stage is stopped at its limit, or at what is left of
    #: ``total_s``, whichever comes first).
    limits_s: dict = dataclasses.field(default_factory=dict)
    total_s: float = 480.0
    parity_large: bool = False  # the hardware-sized parity cases
    parity_repeats: int = 3
    kernel_shapes: tuple = ()
    kernel_dtypes: tuple = ("bf16", "fp32")
    kernel_repeats: int = 5
    linear_shapes: tuple = ()
    linear_dtypes: tuple = ("bf16", "fp32")
    linear_repeats: int = 2  # the Triton linear op took 5 s a call at 8192 x 4096 x 128,256 on an H200
    compile_dtypes: tuple = ("bf16",)  # torch.compile's compile time is the stage's budget: one dtype
    training_steps: int = 30
    fsdp_steps: int = 10
    #: The step stage (:mod:`portarl.bench.step_device`): shapes, steps (the first a warm-up),
    #: tokens per completion, prompts x samples per step.
    step_shapes: tuple = ("tiny",)
    step_steps: int = 2
    step_new_tokens: int = 8
    step_prompts: int = 2
    step_group: int = 2

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, path: str | Path) -> "CheckPlan":
        data = json.loads(Path(path).read_text())
        for key in ("kernel_shapes", "kernel_dtypes", "linear_shapes", "linear_dtypes", "compile_dtypes",
                    "step_shapes"):
            data[key] = tuple(tuple(x) if isinstance(x, list) else x for x in data[key])
        return cls(**data)


def make_plan(device: str, *, quick: bool = False, total_s: float | None = None) -> CheckPlan:
    """The stages' sizes for ``device``; ``quick``: small shapes everywhere (the CPU's full
    plan is the quick one with the linear op's CPU shapes: interpreted kernels at RL shapes
    would take hours)."""
    kind = device.split(":")[0]
    if kind not in ("cuda", "npu", "cpu"):
        raise ValueError(f"--device {device!r}: choose cuda, npu or cpu (or e.g. cuda:1)")
    accelerator = kind != "cpu"
    if quick or not accelerator:
        plan = CheckPlan(
            device=device, quick=True, total_s=total_s or 900.0, parity_large=False,
            parity_repeats=0 if not accelerator else 1,
            kernel_shapes=((64, 512), (256, 4096)), kernel_dtypes=("bf16", "fp32"), kernel_repeats=2,
            linear_shapes=((64, 32, 512),), linear_dtypes=("bf16", "fp32"), compile_dtypes=("fp32",),
            training_steps=4, fsdp_steps=2,
            limits_s={"environment": 120, "parity": 300, "kernels": 240, "training": 420, "step": 120,
                      "hardware-tests": 300},
        )
        return plan
    return CheckPlan(
        device=device, quick=False, total_s=total_s or 480.0, parity_large=True, parity_repeats=3,
        kernel_shapes=RL_LOGPROB_SHAPES, linear_shapes=RL_LINEAR_SHAPES, training_steps=30, fsdp_steps=10,
        step_shapes=("qwen2.5-0.5b", "qwen2.5-1.5b"), step_steps=2, step_new_tokens=512, step_prompts=4, step_group=4,
        # Not yet measured whole on a GPU (the one loan ran without the step stage, and its
        # parity, kernels and tests ran past the limits of then): sized from its stage times.
        limits_s={"environment": 30, "parity": 100, "kernels": 150, "training": 100, "step": 100,
                  "hardware-tests": 150},
    )
