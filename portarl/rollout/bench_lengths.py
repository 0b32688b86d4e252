"""Completion lengths set by a benchmark (``PORTARL_BENCH_LENGTHS``), not by the model.

Why: the gain of partial rollouts depends on the spread of completion lengths, and a small
or untrained model's lengths are whatever its sampling gives (the tiny model rarely ends a
sample). ``portarl bench async --lengths tail:8:512`` and the tests set this variable, and
each sample then ends at a length drawn from its seed alone, the same in every mode (hf
engine): ``tail:MIN:MAX`` draws ``MIN * (MAX / MIN) ** (u ** 3)`` for u uniform in [0, 1)
(most samples short, a few near MAX: a heavy tail); ``even:N`` makes every sample N tokens.
The sample's last token is then the end-of-sequence token and no stop token is drawn
before it (a trained model's own early ends would otherwise cut the tail short); every
token's log-prob is the model's own for it, so the trainer and the engine agree on it as on
any other token. Benchmark and test
instrumentation only: never set in a real run.
"""

from __future__ import annotations

import os

from portarl.rollout.base import seed_of

ENV = "PORTARL_BENCH_LENGTHS"


def spec() -> str | None:
    return os.environ.get(ENV) or None


def target_length(seed: int, text: str | None = None) -> int | None:
    """The length the sample of ``seed`` ends at, or None when lengths are the model's."""
    text = spec() if text is None else text
    if not text:
        return None
    kind, _, rest = text.partition(":")
    try:
        if kind == "even":
            return int(rest)
        if kind == "tail":
            low, high = (int(x) for x in rest.split(":"))
            u = (seed_of(f"{seed}/length") % (1 << 53)) / (1 << 53)
            return max(low, min(high, round(low * (high / low) ** (u ** 3))))
    except ValueError:
        pass
    raise ValueError(f"{ENV}={text!r}: expected tail:MIN:MAX or even:N (benchmark lengths)")
