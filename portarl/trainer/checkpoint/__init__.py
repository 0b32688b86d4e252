"""Checkpoints: atomic writes (:mod:`.manager`), a verified manifest (:mod:`.manifest`) and
trainer state without pickle (:mod:`.safe_state`)."""

from portarl.trainer.checkpoint.manager import CheckpointManager, step_of
from portarl.trainer.checkpoint.manifest import CheckpointError
from portarl.trainer.checkpoint.safe_state import UnsafeStateError, rng_state, seed_global_rngs, set_rng_state

__all__ = ["CheckpointError", "CheckpointManager", "UnsafeStateError", "rng_state", "seed_global_rngs", "set_rng_state", "step_of"]
