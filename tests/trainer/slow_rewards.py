"""A reward that makes each training step last about a second: lets the signal tests send a
second signal while a step is still running (imported by the trainer via PYTHONPATH)."""

import time


def slow_zero(prompt, completion, answer):
    time.sleep(0.06)
    return 0.0
