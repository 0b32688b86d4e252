"""Weight sync without files: the trainer's rank 0 broadcasts each weight version to the
rollout receivers in bucketed collectives; a receiver loads a version whole or not at all.

- :mod:`~portarl.rollout.weight_sync.group`: the group (store + communicator) and liveness;
- :mod:`~portarl.rollout.weight_sync.device_comm`: Gloo on CPU, NCCL / HCCL through vLLM;
- :mod:`~portarl.rollout.weight_sync.buckets`: the wire format (flat buffers, JSON headers);
- :mod:`~portarl.rollout.weight_sync.protocol`: :class:`WeightSender`, :class:`WeightReceiver`.
"""

from portarl.rollout.weight_sync.buckets import DTYPES, WireFormatError
from portarl.rollout.weight_sync.group import PeerLost, SyncGroup, WeightSyncError
from portarl.rollout.weight_sync.protocol import (
    DEFAULT_BUCKET_MB,
    SyncStats,
    TornVersion,
    WeightReceiver,
    WeightSender,
)

__all__ = [
    "DEFAULT_BUCKET_MB",
    "DTYPES",
    "PeerLost",
    "SyncGroup",
    "SyncStats",
    "TornVersion",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WireFormatError",
]
