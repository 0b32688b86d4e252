"""Which fused linear log-probs head a run scores with on a CUDA GPU, decided once at its
start (:mod:`portarl.backends.cuda.linear_heads`): ``train.linear_head`` forces one, or the
heads are timed on the policy's (dtype, H, V), and the choice and its timings are the run's
first event. Under torchrun rank 0 decides and every rank takes its choice: the ranks run
the same head, so their rounding is the same. Elsewhere (CPU, an NPU) nothing happens."""

from __future__ import annotations

import torch

from portarl.runtime import distributed as pdist
from portarl.trainer.guards.precision import DTYPES


def pick_linear_head(trainer) -> str | None:
    """Decide the head for ``trainer``'s policy head; the line to log (rank 0), else None."""
    if trainer.device.type != "cuda":
        return None
    return decide(trainer, trainer.device)


def decide(trainer, device: torch.device) -> str | None:
    """:func:`pick_linear_head`'s work on ``device`` (the CPU in tests: nothing is timed there)."""
    from portarl.backends.cuda import linear_heads

    cfg = trainer.config
    linear_heads.force(cfg.train.linear_head)
    vocab, width = trainer.model.get_output_embeddings().weight.shape  # global shape, sharded or not
    dtype = DTYPES[cfg.precision.dtype]
    # Operands of the policy's shape and dtype: the measurement times its own random rows
    # against a weight of this shape (an FSDP2 shard is never gathered for it).
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(vocab, width, generator=gen, device=device) / width**0.5).to(dtype)
    hidden = torch.empty(1, width, dtype=dtype, device=device)
    head = linear_heads.head_for(hidden, weight) if trainer.dist.is_main else None
    head = pdist.broadcast_json(trainer.dist, head)
    linear_heads.remember(hidden, weight, head)
    line = linear_heads.choice_line(hidden, weight) if trainer.dist.is_main else None
    del weight
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return line
