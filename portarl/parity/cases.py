"""Seeded parity cases: the same input values on every device and every run.

Inputs are generated on the CPU from a per-case seed in float32, rounded to the case's
dtype, then moved to the device under test, so a GPU report and an Ascend report measure
the same numbers and can be compared case by case. Each case states its layout (how the
logits are laid out in memory) because strided slices are the common input in RL.

``standard_cases()`` are small enough for the Triton interpreter (CI);
``hardware_cases()`` add the large shapes (N = 4096 rows at V = 152,064, and so on).
"""

from __future__ import annotations

import dataclasses
import math

import torch

#: The last hardware-sized case's draws (:meth:`LogprobsCase._draws`): one case at a time.
_LAST_DRAWS: dict = {}

#: Layouts a logits case can take in memory.
LAYOUTS = ("contiguous", "sliced", "transposed")

#: Interpreter budget: rows x 4096-column tiles per case (about 6 ms each on one CPU core).
INTERPRETER_TILE = 4096
INTERPRETER_MAX_ROW_TILES = 1024

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}") from None


@dataclasses.dataclass(frozen=True)
class LogprobsCase:
    """Inputs for ``ops.logprobs``: logits ``[*lead, V]`` and labels ``lead``.

    Logits are ``offset + spread * randn``; ``neg_inf_fraction`` of the entries (never a
    label's) are -inf; ``ignore_fraction`` of the labels are ``ignore_index``.
    """

    name: str
    lead: tuple[int, ...]
    vocab: int
    spread: float = 3.0
    offset: float = 0.0
    temperature: float = 1.0
    ignore_fraction: float = 0.1
    neg_inf_fraction: float = 0.0
    layout: str = "contiguous"
    seed: int = 0
    ignore_index: int = -100

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {LAYOUTS}")
        if self.layout == "transposed" and len(self.lead) != 1:
            raise ValueError("a transposed case has one leading dimension")

    @property
    def n_rows(self) -> int:
        return math.prod(self.lead)

    def fits_interpreter(self) -> bool:
        """Small enough for the Triton interpreter (CI): it runs one row-tile at a time in numpy."""
        tiles = -(-self.vocab // INTERPRETER_TILE)
        return self.n_rows * tiles <= INTERPRETER_MAX_ROW_TILES

    def input_scale(self) -> float:
        """Bound on max|z| (z = logits / T): sets the fp32 accumulation tolerance."""
        return (abs(self.offset) + 6.0 * self.spread) / self.temperature

    def _draws(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The case's random draws in fp32, before any dtype: the same for every backend and
        dtype, so the last case's are kept (:data:`_LAST_DRAWS`): the hardware-sized cases
        run backend by backend and dtype by dtype in a row, and drawing 600 M values on the
        host took most of each one's time on a GPU."""
        key = (self.name, self.seed, self.lead, self.vocab)
        if _LAST_DRAWS.get("key") == key:
            return _LAST_DRAWS["draws"]
        _LAST_DRAWS.clear()
        gen = torch.Generator().manual_seed(self.seed)
        n, v = self.n_rows, self.vocab
        values = self.offset + self.spread * torch.randn(n, v, generator=gen)
        labels = torch.randint(0, v, (n,), generator=gen)
        if self.neg_inf_fraction > 0 and v > 1:
            hole = torch.rand(n, v, generator=gen) < self.neg_inf_fraction
            hole[torch.arange(n), labels] = False  # labels stay on finite entries
            values = values.masked_fill(hole, float("-inf"))
        ignored = torch.rand(n, generator=gen) < self.ignore_fraction
        labels = torch.where(ignored, self.ignore_index, labels)
        storage = None
        if self.layout == "sliced":
            *outer, t = self.lead
            storage = torch.randn(*outer, t + 1, v, generator=gen)
        draws = (values, labels, storage)
        if values.numel() >= 1 << 24:  # only the hardware-sized cases are worth the host memory
            _LAST_DRAWS.update(key=key, draws=draws)
        return draws

    def make(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        values, labels, noise = self._draws()
        v = self.vocab
        values = values.to(dtype, copy=True)  # the draws are kept: nothing downstream may write into them
        labels = labels.reshape(self.lead)
        if self.layout == "contiguous":
            logits = values.reshape(*self.lead, v)
        elif self.layout == "sliced":
            # [*lead[:-1], T + 1, V] storage read as [..., :-1, :], like logits[:, :-1].
            *outer, t = self.lead
            storage = noise.to(dtype, copy=True)
            storage[..., :-1, :] = values.reshape(*outer, t, v)
            logits = storage[..., :-1, :]
        else:  # transposed: column stride != 1
            logits = values.t().contiguous().t()
        return logits.to(device), labels.to(device)


@dataclasses.dataclass(frozen=True)
class KLCase:
    """Inputs for ``ops.kl``: log-probs ``logp`` and ``ref_logp`` of shape ``shape``.

    ``logp`` is ``-|spread * randn|`` (a log-probability), ``ref_logp = logp + gap * randn``;
    ``extreme`` adds entries whose log-ratio is beyond the clamps in both directions.
    """

    name: str
    shape: tuple[int, ...]
    gap: float = 0.3
    spread: float = 2.0
    mask_fraction: float = 0.0
    extreme: bool = False
    seed: int = 0

    def input_scale(self) -> float:
        return 30.0 if self.extreme else 6.0 * (self.spread + self.gap)

    def make(self, dtype: torch.dtype, device: torch.device | str = "cpu"):
        gen = torch.Generator().manual_seed(self.seed)
        logp = -(self.spread * torch.randn(self.shape, generator=gen)).abs()
        ref = logp + self.gap * torch.randn(self.shape, generator=gen)
        if self.extreme:
            flat = ref.view(-1)
            k = max(1, flat.numel() // 8)
            flat[:k] = logp.view(-1)[:k] - 25.0  # d = -25: below the clamp
            flat[k : 2 * k] = logp.view(-1)[k : 2 * k] + 25.0  # d = +25: exp overflows the cap
        mask = None
        if self.mask_fraction > 0:
            mask = torch.rand(self.shape, generator=gen) >= self.mask_fraction
        out = [logp.to(dtype).to(device), ref.to(dtype).to(device)]
        return out[0], out[1], (None if mask is None else mask.to(device))


def standard_logprobs_cases() -> list[LogprobsCase]:
    """Every property the issue names, at shapes the Triton interpreter runs in CI."""
    return [
        LogprobsCase("v1", lead=(8,), vocab=1, seed=1),
        LogprobsCase("v17", lead=(33,), vocab=17, seed=2),
        LogprobsCase("v4099_batched", lead=(2, 3), vocab=4099, seed=3),
        LogprobsCase("v32000", lead=(3,), vocab=32000, seed=4),
        LogprobsCase("v152064", lead=(2,), vocab=152064, seed=5),
        LogprobsCase("n1", lead=(1,), vocab=64, ignore_fraction=0.0, seed=6),
        LogprobsCase("n512", lead=(512,), vocab=33, seed=7),
        # Too many rows for the interpreter: reference and npu (stand-in) in CI, Triton on hardware.
        LogprobsCase("n4096", lead=(64, 64), vocab=17, seed=15),
        LogprobsCase("sliced", lead=(2, 5), vocab=300, layout="sliced", seed=8),
        LogprobsCase("transposed", lead=(6,), vocab=257, layout="transposed", seed=9),
        LogprobsCase("all_ignored", lead=(5,), vocab=100, ignore_fraction=1.0, seed=10),
        LogprobsCase("magnitude_1e4", lead=(4,), vocab=1000, offset=1e4, spread=30.0, seed=11),
        LogprobsCase("spread_1e4", lead=(4,), vocab=1000, spread=1e4 / 6, seed=12),
        LogprobsCase("neg_inf", lead=(7,), vocab=500, neg_inf_fraction=0.5, seed=13),
        LogprobsCase("temperature_0.7", lead=(6,), vocab=777, temperature=0.7, seed=14),
    ]


def hardware_logprobs_cases() -> list[LogprobsCase]:
    """Large shapes, for real devices (too slow for the interpreter)."""
    return [
        LogprobsCase("hw_n4096_v32000", lead=(4096,), vocab=32000, seed=101),
        LogprobsCase("hw_n4096_v152064", lead=(4096,), vocab=152064, seed=102),
        LogprobsCase("hw_sliced_4x1025_v152064", lead=(4, 1025), vocab=152064, layout="sliced", seed=103),
        LogprobsCase("hw_n2048_v4099_t0.7", lead=(2048,), vocab=4099, temperature=0.7, seed=104),
        LogprobsCase("hw_n1024_v262144", lead=(1024,), vocab=262144, seed=105),
    ]


def standard_kl_cases() -> list[KLCase]:
    return [
        KLCase("kl_small", shape=(7,), seed=21),
        KLCase("kl_batched", shape=(4, 257), seed=22),
        KLCase("kl_masked", shape=(3, 100), mask_fraction=0.3, seed=23),
        KLCase("kl_extreme", shape=(64,), extreme=True, seed=24),
        KLCase("kl_far", shape=(1000,), gap=3.0, seed=25),
    ]


def hardware_kl_cases() -> list[KLCase]:
    return [KLCase("hw_kl_1m", shape=(256, 4096), mask_fraction=0.2, seed=121)]


def find_logprobs_case(name: str) -> LogprobsCase:
    for case in standard_logprobs_cases() + hardware_logprobs_cases():
        if case.name == name:
            return case
    raise KeyError(name)
