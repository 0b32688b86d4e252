"""linear_logprobs in the parity sweep: seeded cases, forward and every gradient vs float64."""

from __future__ import annotations

import dataclasses

import torch

from portarl import ops
from portarl.parity import cases as case_lib
from portarl.parity.float64 import linear_logprobs_float64
from portarl.parity.tolerances import contracted_gradient, fp32_result


@dataclasses.dataclass(frozen=True)
class LinearCase:
    name: str
    rows: int
    vocab: int
    hidden: int
    bias: bool = False
    temperature: float = 1.0
    seed: int = 0

    def fits_interpreter(self) -> bool:
        return self.vocab * self.hidden <= 4_000_000

    def make(self, dtype, device):
        gen = torch.Generator().manual_seed(self.seed)
        h = torch.randn(self.rows, self.hidden, generator=gen)
        w = torch.randn(self.vocab, self.hidden, generator=gen) * (2.0 / self.hidden**0.5)
        b = torch.randn(self.vocab, generator=gen) if self.bias else None
        labels = torch.randint(0, self.vocab, (self.rows,), generator=gen)
        labels[::3] = -100
        cast = lambda t: None if t is None else t.to(dtype).to(device)  # noqa: E731
        return cast(h), cast(w), cast(b), labels.to(device)


def standard_linear_cases() -> list[LinearCase]:
    return [
        LinearCase("lin_v17_h8_bias_t07", 9, 17, 8, bias=True, temperature=0.7, seed=1),
        LinearCase("lin_v4099_h64", 6, 4099, 64, seed=2),
        LinearCase("lin_v32000_h896", 3, 32000, 896, seed=3),
    ]


def run_linear_logprobs_case(case: LinearCase, backend: str, dtype: torch.dtype, device: torch.device,
                             repeats: int = 3) -> list:
    from portarl.parity.record import Record, fill, timed

    base = dict(op="linear_logprobs", case=case.name, backend=backend, dtype=case_lib.DTYPE_NAMES[dtype])
    h, w, b, labels = case.make(dtype, device)
    gen = torch.Generator().manual_seed(case.seed + 7)
    g1, g2 = torch.randn(labels.shape, generator=gen), 0.5 * torch.randn(labels.shape, generator=gen)
    kwargs = dict(bias=b, temperature=case.temperature, return_entropy=True, backend=backend)

    def forward():
        with torch.no_grad():
            return ops.linear_logprobs(h, w, labels, **kwargs)

    def forward_backward():
        hl, wl = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
        logp, ent = ops.linear_logprobs(hl, wl, labels, **kwargs)
        torch.autograd.backward((logp, ent), (g1.to(device), g2.to(device)))
        return logp, ent, hl.grad, wl.grad

    quantities = ("logp", "entropy", "grad_hidden", "grad_weight")
    try:
        _, f_ms = timed(forward, device, repeats)
        (logp, ent, gh, gw), fb_ms = timed(forward_backward, device, repeats)
    except Exception as err:  # reported as a failed case, not a crashed sweep
        return [Record(**base, quantity=q, error=f"{type(err).__name__}: {err}") for q in quantities]
    ref = linear_logprobs_float64(h, w, labels, bias=b, temperature=case.temperature, grad_logp=g1, grad_entropy=g2)
    z = h.double().cpu() @ w.double().cpu().T + (b.double().cpu() if b is not None else 0.0)
    scale = float(z.abs().max()) / case.temperature
    gz = ref["grad_logits"].abs()
    mass_h = float(gz.sum(-1).max()) * float(w.double().abs().max())
    mass_w = float(gz.sum(0).max()) * float(h.double().abs().max())
    t = dict(forward_ms=f_ms, backward_ms=max(0.0, fb_ms - f_ms))
    return [
        fill(Record(**base, quantity="logp", **t), logp, ref["logp"], fp32_result(scale), case.seed),
        fill(Record(**base, quantity="entropy", **t), ent, ref["entropy"], fp32_result(scale), case.seed),
        fill(Record(**base, quantity="grad_hidden", **t), gh, ref["grad_hidden"],
              contracted_gradient(scale, mass_h, dtype), case.seed),
        fill(Record(**base, quantity="grad_weight", **t), gw, ref["grad_weight"],
              contracted_gradient(scale, mass_w, dtype), case.seed),
    ]
