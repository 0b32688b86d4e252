"""A reward that can hold a training step open: lets the signal tests send both signals while
a step is certainly still running (imported by the trainer via PYTHONPATH).

When ``$HOLD_DIR/hold`` exists, the next call creates ``$HOLD_DIR/holding`` and waits until
``$HOLD_DIR/release`` appears (at most 600 s, longer than any test waits for the process);
otherwise it returns at once. A held step therefore ends only by the test's word or by the
process dying, never by a sleep that a loaded machine could outlast.

The first stop signal ends a reward call in progress (portarl.runtime.user_code) with an exception
that is not a KeyboardInterrupt; this reward swallows it, as a reward with a bare
``except`` would, so the step stays open until the second signal's abort (a
KeyboardInterrupt, let through) ends it."""

import os
import time
from pathlib import Path


def held_zero(prompt, completion, answer):
    gate = Path(os.environ["HOLD_DIR"])
    if (gate / "hold").exists():
        (gate / "holding").touch()
        end = time.monotonic() + 600
        while not (gate / "release").exists() and time.monotonic() < end:
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                raise
            except BaseException:  # noqa: BLE001  (the first signal's end-this-call: held on purpose)
                (gate / "ignored-first-signal").touch()
    return 0.0
