"""What async mode (``rollout.mode: async``) checks before its worker starts, and how long
the ranks under torchrun wait for rank 0's batch: the settings side of
:mod:`portarl.trainer.asynchronous.pipeline`."""

from __future__ import annotations

import os

from portarl.backends.device import check_worker_devices
from portarl.trainer.asynchronous.client import STARTUP_MIN_S


def check_async_trainer(trainer) -> None:
    """What async mode cannot do (yet), refused before the worker starts."""
    if trainer.rollout_if_built is not None:
        raise ValueError("rollout.mode=async builds its own engine in a worker process: do not pass rollout_engine")
    if trainer.config.rollout.worker_devices:  # under torchrun rank r trains on device r of this node
        check_worker_devices(trainer.config.rollout.worker_devices, trainer.device,
                             int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if trainer.dist.enabled else None)
    if trainer.config.rollout.engine == "vllm":  # else the worker dies at start-up with it in its log
        from portarl.rollout.vllm import vllm_unavailable_reason

        reason = vllm_unavailable_reason()
        if reason is not None:
            raise ValueError(f"rollout.engine=vllm with rollout.mode=async: the rollout worker runs vLLM, but {reason}")
    if trainer.config.rollout.partial:
        if trainer.agent is not None or trainer.config.tools or trainer.config.environment:
            raise ValueError("rollout.partial with tools or an environment (multi-turn episodes) is not supported yet: "
                             "set rollout.partial=false")
        if trainer.vision_inputs(trainer.examples[:1], 1) is not None:
            raise ValueError("rollout.partial with a vision-language model is not supported yet: set "
                             "rollout.partial=false")
    if not trainer.rewards_from_config:
        raise ValueError("rollout.mode=async computes rewards in the worker process, which can only load the config's "
                         "rewards (rewards: [{name: module:function}]): pass reward_fns=None")


def share_timeout_s(cfg) -> float:
    """How long a rank other than 0 waits for rank 0's batch. Rank 0 gives up by itself
    (and sends its error) after its start-up wait plus at most 2 x max_staleness + 3
    replies (a ``loaded`` per version and a batch per step in flight, one regenerated
    batch), each within ``rollout.timeout_s``, after writing the weights (bounded like a
    collective, ``distributed.timeout_s``); this is twice that. A backstop only: a rank 0
    that dies ends the job through torchrun and the heartbeat."""
    r = cfg.rollout
    return 2 * (max(r.timeout_s, STARTUP_MIN_S) + (2 * r.max_staleness + 3) * r.timeout_s + cfg.distributed.timeout_s)


__all__ = ["check_async_trainer", "share_timeout_s"]
