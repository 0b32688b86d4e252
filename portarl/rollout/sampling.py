"""Token sampling on the device with a counter-based per-sample random stream.

Why counter-based: each sample must draw from its own stream, fixed by its seed alone, so
that a completion does not depend on what else is in the batch (and the G samples of a
group differ). Stateful per-sample generators (``torch.Generator`` per row) force a host
round trip per token: a B x V copy of the logits to the host and B CPU draws. A counter-
based generator is a pure function ``bits = F(key, counter)``: every row computes its own
uniforms on the device in one batched op, and the uniforms of a row depend only on that
row's key and counter.

Generator: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
1, 2, 3", SC 2011; cuRAND's and torch's CUDA generator use the same algorithm), written
with int64 tensor ops (each 32 x 32-bit product split into 16-bit halves, so nothing
overflows), so it needs no device-specific kernel (int64 multiply, shift, and, xor; run on
CPU here, no accelerator was available). Checked against the Random123 known-answer vectors
in the tests.

Key and counter layout, per row (sample) and per drawn word:
- key ``(k0, k1)`` = (low 32 bits, high 32 bits) of the sample's 63-bit seed;
- counter ``(c0, c1, c2, c3)`` = (vocabulary word ``v // 4``, completion position ``t``,
  stream ``STREAM_TOKEN`` = 0 for the token draw, 0); output word ``v % 4`` is token v's.
The uniform for token ``v`` at position ``t`` is therefore a function of (seed, t, v) only.

Sampling stays exactly Gumbel-max over the filtered, temperature-scaled logits:
``argmax_v (z_v / T - log(-log u_v))`` with ``u_v`` uniform on (0, 1) and ``z_v = -inf``
outside the top-k / top-p set, which draws v with probability softmax(z/T) restricted to
that set. Uniforms carry 23 bits: ``u = (m + 0.5) * 2**-23`` is exact in fp32 and never 0
or 1 (``torch.rand`` in fp32 has 24).

Cost: ceil(V / 4) Philox evaluations (10 rounds of a few int64 ops) per row and position,
all on the device; at B 512 x V 152k each int64 temporary is about 156 MB, drawn one
position per call (``portarl.rollout.hf.NOISE_WORDS_PER_CALL``), where the former sampler
copied 311 MB of logits to the host per token.
"""

from __future__ import annotations

import torch

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32, _MASK16 = 0xFFFFFFFF, 0xFFFF
ROUNDS = 10
STREAM_TOKEN = 0


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product m * x, x holding uint32 values in int64.
    The constant m is split into 16-bit halves (host integers), not x: 9 tensor ops."""
    low = x * (m & _MASK16)  # < 2**48
    s = x * (m >> 16)
    s += low >> 16  # < 2**49
    return s >> 16, ((s & _MASK16) << 16) | (low & _MASK16)


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor], rounds: int = ROUNDS):
    """Philox4x32 on int64 tensors holding uint32 values (broadcast together); returns 4 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def seed_keys(seeds: list[int], device) -> torch.Tensor:
    """[B, 2] int64 Philox keys (low, high 32 bits) from non-negative seeds below 2**64."""
    for s in seeds:
        if not 0 <= s < 1 << 64:
            raise ValueError(f"sample seed {s} is outside [0, 2**64)")
    return torch.tensor([[s & _MASK32, s >> 32] for s in seeds], dtype=torch.int64, device=device)


def uniform_span(keys: torch.Tensor, start: int, count: int, vocab: int, stream: int = STREAM_TOKEN) -> torch.Tensor:
    """[B, count, vocab] fp32 uniforms on (0, 1) for positions start .. start + count - 1.

    One batched Philox call for several positions (fewer small ops per token on a CPU);
    the values do not depend on how positions are grouped into calls."""
    words = -(-vocab // 4)
    dev = keys.device
    c0 = torch.arange(words, dtype=torch.int64, device=dev)[None, None, :]
    c1 = torch.arange(start, start + count, dtype=torch.int64, device=dev)[None, :, None]
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    out = philox4x32((c0, c1, zero + stream, zero), (keys[:, :1, None], keys[:, 1:, None]))
    bits = torch.stack(out, dim=-1).reshape(keys.shape[0], count, 4 * words)[..., :vocab]
    return ((bits >> 9).float() + 0.5) * 2.0**-23


def uniforms(keys: torch.Tensor, position: int, vocab: int, stream: int = STREAM_TOKEN) -> torch.Tensor:
    """[B, vocab] fp32 uniforms on (0, 1) for one completion position; row b from keys[b]."""
    return uniform_span(keys, position, 1, vocab, stream)[:, 0]


def filter_logits(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf outside the top-k / nucleus (top-p) set of each row; z is fp32 [B, V]."""
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def sample_tokens(logits: torch.Tensor, keys: torch.Tensor, position: int, *, temperature: float,
                  top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                  u: torch.Tensor | None = None) -> torch.Tensor:
    """[B] int64 token ids drawn from softmax(logits / T) restricted to top-k / top-p, on the
    logits' device; row b uses only keys[b] and ``position`` (see the module docstring).
    ``u``: this position's uniforms when already drawn (``uniform_span``)."""
    z = logits.float() / temperature
    if greedy:
        return z.argmax(-1)
    z = filter_logits(z, top_k, top_p)
    if u is None:
        u = uniforms(keys, position, z.shape[-1])
    return (z - torch.log(-torch.log(u))).argmax(-1)
