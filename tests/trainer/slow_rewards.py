"""A reward that can hold a training step open: lets the signal tests send both signals while
a step is certainly still running (imported by the trainer via PYTHONPATH).

When ``$HOLD_DIR/hold`` exists, the next call creates ``$HOLD_DIR/holding`` and sleeps (up to
60 s); otherwise it returns at once."""

import os
import time
from pathlib import Path


def held_zero(prompt, completion, answer):
    gate = Path(os.environ["HOLD_DIR"])
    if (gate / "hold").exists():
        (gate / "holding").touch()
        time.sleep(60)
    return 0.0
