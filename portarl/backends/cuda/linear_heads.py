"""Which head computes ``ops.linear_logprobs`` on the cuda backend: chosen by measurement,
never by the batch.

Three heads meet the op's contract (fp32 sums of exact products, float64-checked) and are
batch invariant (a row's bits never depend on the other rows):

- ``split``: the split-vocabulary Triton head (:mod:`portarl.backends.cuda.linear_split`);
- ``cublas``: cuBLAS GEMMs on fixed-shape row chunks, then the Triton row kernels
  (:mod:`portarl.backends.cuda.linear_cublas`);
- ``tile``: the chunked Triton tile head (:mod:`portarl.backends.cuda.linear_logprobs`).

Which is fastest depends on the GPU, the dtype and the shape, so on a GPU the first use
for a (device, dtype, H, V) times each head's forward + backward at a fixed row count
(:data:`MEASURE_ROWS`, never the caller's), keeps the fastest for the process, caches it
on disk per device and library versions (``$PORTARL_CACHE_DIR``, default
``~/.cache/portarl``, ``linear-heads.json``), and logs the choice with every timing. The
choice is a function of (device, dtype, H, V) alone: a row's result then depends on its
own inputs only, whichever head won. ``PORTARL_LINEAR_HEAD=split|cublas|tile`` (or
``train.linear_head``, which sets it) forces a head. Under the Triton interpreter (CPU
tensors) nothing is timed: ``tile`` unless forced.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("portarl.ops")

HEADS = ("split", "cublas", "tile")
#: Forces a head (one of :data:`HEADS`); ``auto`` or unset: measured.
HEAD_ENV = "PORTARL_LINEAR_HEAD"
#: Rows of the timed problem: the choice must not depend on the caller's batch.
MEASURE_ROWS = 4096
#: Timed repetitions per head after one warm-up (the median is kept).
MEASURE_REPEATS = 3

#: (device, dtype, H, V) -> head, for this process.
_CHOSEN: dict[tuple, str] = {}
#: A head forced for the process by :func:`force` (``train.linear_head``); the environment's wins.
_FORCED: list[str | None] = [None]
#: (device, dtype, H, V) -> {head: seconds or None}, the measurements behind _CHOSEN (logged).
TIMINGS: dict[tuple, dict] = {}


def _run(name: str) -> Callable:
    if name == "split":
        from portarl.backends.cuda.linear_split import split_linear_logprobs

        return split_linear_logprobs
    from portarl.backends.cuda.linear_logprobs import triton_linear_logprobs

    if name == "cublas":
        from portarl.backends.cuda.linear_cublas import FixedChunkMath

        return lambda *a, **k: triton_linear_logprobs(*a, math=FixedChunkMath, **k)
    return triton_linear_logprobs


def force(name: str | None) -> None:
    """Force ``name`` (one of :data:`HEADS`) for this process, or ``None`` / ``"auto"`` to
    measure (``train.linear_head``; ``PORTARL_LINEAR_HEAD`` still wins)."""
    if name not in (None, "auto", *HEADS):
        raise ValueError(f"linear head {name!r}: must be one of auto, {', '.join(HEADS)}")
    _FORCED[0] = None if name == "auto" else name


def forced_head() -> str | None:
    """The head ``PORTARL_LINEAR_HEAD`` names, else the one :func:`force` set; None for
    ``auto`` / unset; a bad value is refused."""
    raw = os.environ.get(HEAD_ENV, "auto").strip().lower()
    if raw in ("", "auto"):
        return _FORCED[0]
    if raw not in HEADS:
        raise ValueError(f"{HEAD_ENV}={raw!r}: must be one of auto, {', '.join(HEADS)} (or unset)")
    return raw


def _key(hidden: torch.Tensor, weight: torch.Tensor) -> tuple:
    device = hidden.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return name, str(hidden.dtype).removeprefix("torch."), weight.shape[1], weight.shape[0]


def head_for(hidden: torch.Tensor, weight: torch.Tensor, measure: Callable | None = None) -> str:
    """The head for these operands' (device, dtype, H, V): forced, remembered, cached on
    disk, or measured now (``measure(hidden, weight) -> {head: seconds}``, default
    :func:`measure_heads`)."""
    forced = forced_head()
    if forced is not None:
        return forced
    if hidden.device.type != "cuda":
        return "tile"  # the interpreter: nothing worth timing
    key = _key(hidden, weight)
    if key in _CHOSEN:
        return _CHOSEN[key]
    cached = _read_cache().get(_cache_key(key))
    if cached in HEADS:
        _CHOSEN[key] = cached
        log.info("linear log-probs head for %s %s H=%d V=%d: %s (cached in %s)", *key, cached, cache_path())
        return cached
    timings = (measure or measure_heads)(hidden, weight)
    choice = choose(timings)
    _CHOSEN[key], TIMINGS[key] = choice, timings
    _write_cache(_cache_key(key), choice)
    log.info("linear log-probs head for %s %s H=%d V=%d: %s (forward+backward of %d rows: %s)", *key, choice,
             MEASURE_ROWS, describe(timings))
    return choice


def choose(timings: dict) -> str:
    """The fastest head that ran (a head that failed is None); ``tile`` if none did."""
    ran = {k: v for k, v in timings.items() if v is not None}
    return min(ran, key=lambda k: (ran[k], HEADS.index(k))) if ran else "tile"


def describe(timings: dict) -> str:
    return ", ".join(f"{k} {'failed' if v is None else f'{v * 1e3:.2f} ms'}" for k, v in timings.items())


def measure_heads(hidden: torch.Tensor, weight: torch.Tensor) -> dict:
    """Median seconds of forward (with entropy) + backward (hidden and weight) of each head
    on :data:`MEASURE_ROWS` random rows and the caller's weight; None where a head failed."""
    gen = torch.Generator(device=hidden.device).manual_seed(0)
    vocab, width = weight.shape
    h = (torch.randn(MEASURE_ROWS, width, generator=gen, device=hidden.device) / width**0.5).to(hidden.dtype)
    labels = torch.randint(0, vocab, (MEASURE_ROWS,), generator=gen, device=hidden.device)
    w = weight.detach()
    out = {}
    for name in HEADS:
        run = _run(name)

        def once():
            hh, ww = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
            logp, ent = run(hh, ww, None, labels, temperature=1.0, ignore_index=-100, return_entropy=True)
            (logp.sum() + ent.sum()).backward()

        try:
            out[name] = _median_seconds(once, hidden.device)
        except (RuntimeError, torch.OutOfMemoryError) as err:  # a head that cannot run here is not chosen
            log.warning("linear log-probs head %s failed while being timed: %s", name, err)
            out[name] = None
        torch.cuda.empty_cache()
    return out


def _median_seconds(fn: Callable, device: torch.device) -> float:
    fn()  # warm-up: compiles the kernels, allocates
    times = []
    for _ in range(MEASURE_REPEATS):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def reset() -> None:
    """Forget this process's choices (tests)."""
    _CHOSEN.clear()
    TIMINGS.clear()
    _FORCED[0] = None


def remember(hidden: torch.Tensor, weight: torch.Tensor, head: str) -> None:
    """Take ``head`` for these operands' (device, dtype, H, V) without measuring: another
    rank's choice under torchrun, so that every rank runs the same head."""
    if head not in HEADS:
        raise ValueError(f"linear head {head!r}: must be one of {', '.join(HEADS)}")
    _CHOSEN[_key(hidden, weight)] = head


def choice_line(hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """One line for the run's log: the head these operands get, and why."""
    key = _key(hidden, weight)
    head = head_for(hidden, weight)
    why = ("forced" if forced_head() is not None else
           f"measured: {describe(TIMINGS[key])}" if key in TIMINGS else "cached or another rank's choice")
    return f"linear log-probs head on {key[0]} ({key[1]}, H={key[2]}, V={key[3]}): {head} ({why})"


# ------------------------------------------------------------------------- the disk cache
def cache_path() -> Path:
    return Path(os.environ.get("PORTARL_CACHE_DIR") or Path.home() / ".cache" / "portarl") / "linear-heads.json"


def _cache_key(key: tuple) -> str:
    import triton

    import portarl

    device, dtype, width, vocab = key
    versions = f"torch {torch.__version__}, triton {triton.__version__}, portarl {portarl.__version__}"
    return f"{device} | {versions} | {dtype} H={width} V={vocab}"


def _read_cache() -> dict:
    path = cache_path()
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("ignoring the linear head cache %s: %s", path, err)
        return {}


def _write_cache(key: str, choice: str) -> None:
    """Add ``key: choice`` (atomically: a file other processes may read at the same time)."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache()
        data[key] = choice
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as err:  # a read-only home: the choice still holds for this process
        log.warning("could not cache the linear head choice in %s: %s", path, err)


def linear_logprobs(hidden, weight, bias, labels, *, temperature, ignore_index, return_entropy):
    """The cuda backend's ``linear_logprobs``: the head :func:`head_for` picks."""
    return _run(head_for(hidden, weight))(hidden, weight, bias, labels, temperature=temperature,
                                          ignore_index=ignore_index, return_entropy=return_entropy)
