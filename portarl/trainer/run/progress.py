"""Progress bars: one per phase, and nobody else's inside ours.

Why: the SFT warm-up used to run inside the GRPO bar, so its first ETA was computed from
warm-up steps (55 minutes shown for a two-minute run); now each phase has its own bar.
transformers draws a "Writing model shards" bar at every ``save_pretrained``, which broke
our bar at every checkpoint; :func:`quiet_third_party` turns those off.
"""

from __future__ import annotations

import os
import sys


def quiet_third_party() -> None:
    """Turn off the progress bars transformers and huggingface_hub would draw (checkpoint
    writes, shard loading) while portarl's own bar is on screen."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def progress_bar(total: int, desc: str, *, initial: int = 0, enabled: bool = True, unit: str = "step"):
    """A tqdm bar on stderr, or None when disabled or tqdm is missing."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    quiet_third_party()
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)
