"""The chaos run's modes: how each launches ``portarl train``, the settings it adds, the
faults that apply to it, and what it guarantees after them.

Every mode trains the built-in tiny model (or a built-in tiny MoE) on the synthetic sums with
:func:`portarl.bench.chaos.rewards.varied` (the weights move from the first step) and, weight
0.1, the chaos judge. A checkpoint every ``checkpoint_every`` steps."""

from __future__ import annotations

import dataclasses
import sys

#: The faults every mode meets.
COMMON = ["sigkill_trainer", "sigterm_job", "disk_full_checkpoint", "judge_outage", "reward_raises"]


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    ranks: int
    sets: tuple[str, ...]
    kinds: tuple[str, ...]
    #: what the final weights and metrics are held to: "bitwise" with the uninterrupted run
    guarantee: str = "bitwise"


MODES = {
    "colocated": Mode("colocated", 1, (), (*COMMON,)),
    # File weight sync, so that a weight publish is a write a full disk can fail.
    "async": Mode("async", 1, ("rollout.mode=async", "rollout.weight_sync=file"),
                  (*COMMON, "sigkill_worker", "disk_full_weights")),
    "torchrun": Mode("torchrun", 2, (), (*COMMON, "sigkill_rank")),
    "ulysses": Mode("ulysses", 2, ("train.sequence_parallel_size=2", "train.gradient_checkpointing=true",
                                   "train.old_logprobs=recompute"), (*COMMON, "sigkill_rank")),
    "moe": Mode("moe", 1, ("model.path=tiny-qwen3-moe", "rollout.routing_replay=rollout",
                           "train.old_logprobs=recompute"), (*COMMON,)),
}


def base_sets(steps: int, checkpoint_every: int, judge_url: str) -> list[str]:
    """The settings of every mode: a small, fast run whose reward varies within groups."""
    return [
        f"train.steps={steps}", "train.prompts_per_step=4", "train.sft_warmup_steps=0", "train.micro_batch_size=8",
        "rollout.group_size=4", "rollout.max_new_tokens=3", "data.synthetic_size=64", "model.hidden_size=32",
        "model.intermediate_size=64", "optim.lr=1e-3", "loss.kl_coef=0.01", "logging.progress=false",
        "logging.trackers=[]", "logging.plot=false", f"checkpoint.every={checkpoint_every}", "checkpoint.keep_last=2",
        "rewards=[{name: 'portarl.bench.chaos.rewards:varied'}, "
        f"{{judge: '{judge_url}', model: chaos-judge, name: judge, weight: 0.1, timeout_s: 5, retries: 2}}]",
    ]


def command(mode: Mode, out, sets: list[str], *, resume: bool) -> list[str]:
    """``portarl train`` for ``mode`` (torchrun on this machine for more than one rank)."""
    if mode.ranks > 1:
        from portarl.runtime.distributed import local_launcher

        launcher = [*local_launcher(mode.ranks), "-m", "portarl"]
    else:
        launcher = [sys.executable, "-m", "portarl"]
    cmd = [*launcher, "train", "--device", "cpu", "--output-dir", str(out)]
    for item in (*sets, *mode.sets):
        cmd += ["--set", item]
    return cmd + (["--resume-or-start"] if resume else [])


__all__ = ["COMMON", "MODES", "Mode", "base_sets", "command"]
