"""float64 references: the obviously-correct formulas, with autograd, on the CPU by default.

These define the numbers every backend is held to. They are row-chunked only so that
larger hardware cases fit in memory (the input goes to float64 a chunk at a time, and the
outputs are filled in place: one float64 copy of the result, not two); rows are
independent, so chunking changes nothing. They implement the ops' contracts for non-finite
input explicitly (a row with NaN or +inf is NaN throughout).

Where: the CPU, unless :func:`computed_on` names a device. ``portarl hardware-check`` runs
them on a GPU under test for the hardware-sized cases (:func:`reference_device_for`; an
Ascend NPU keeps them on the CPU): a 4,096 x 152,064 case is 5 GB in float64, and a host
computing it for every backend and dtype would take the whole device loan. IEEE float64 on a
GPU rounds its basic operations exactly as the CPU does; exp / log may differ in the last
ulp (1e-16 relative), eleven orders of magnitude below the tightest tolerance of
:mod:`portarl.parity.tolerances`. The report records where.
"""

from __future__ import annotations

import contextlib

import torch

_CHUNK_ELEMENTS = 1 << 24
_DEVICE = torch.device("cpu")


def reference_device() -> torch.device:
    """Where the float64 references (and the error measurements) run now."""
    return _DEVICE


def reference_device_for(device: torch.device | str) -> torch.device:
    """Where the float64 references of results on ``device`` should run: a CUDA device itself
    (IEEE float64 at full speed, and no host copy of a 5 GB case); the CPU otherwise: an
    Ascend NPU runs float64 slowly or not at all (many of its kernels have no double type)."""
    device = torch.device(device)
    return device if device.type == "cuda" else torch.device("cpu")


@contextlib.contextmanager
def computed_on(device: torch.device | str):
    """Run the float64 references and error measurements on ``device`` inside the block."""
    global _DEVICE
    previous, _DEVICE = _DEVICE, torch.device(device)
    try:
        yield _DEVICE
    finally:
        _DEVICE = previous


def logprobs_float64(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    grad_logp: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """float64 ``logp``, ``entropy`` (shape of labels) and, given upstream gradients,
    ``grad`` = d(sum(grad_logp * logp + grad_entropy * entropy)) / d logits (shape of logits)."""
    n_cols = logits.shape[-1]
    x_all = logits.detach().reshape(-1, n_cols)  # converted to float64 chunk by chunk
    y_all = labels.detach().to(_DEVICE).reshape(-1)
    n_rows = y_all.shape[0]
    want_grad = grad_logp is not None or grad_entropy is not None
    g1_all = None if grad_logp is None else grad_logp.detach().to(_DEVICE, torch.float64).reshape(-1)
    g2_all = None if grad_entropy is None else grad_entropy.detach().to(_DEVICE, torch.float64).reshape(-1)
    out_logp = torch.empty(n_rows, dtype=torch.float64, device=_DEVICE)
    out_entropy = torch.empty(n_rows, dtype=torch.float64, device=_DEVICE)
    out_grad = torch.empty(n_rows, n_cols, dtype=torch.float64, device=_DEVICE) if want_grad else None
    step = max(1, _CHUNK_ELEMENTS // max(1, n_cols))
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        x = x_all[rows].to(_DEVICE, torch.float64, copy=True).requires_grad_(want_grad)
        y = y_all[rows]
        valid = y != ignore_index
        bad_row = (torch.isnan(x) | (x == float("inf"))).any(dim=-1, keepdim=True)
        z = torch.where(bad_row, float("nan"), x) / temperature
        log_sm = torch.log_softmax(z, dim=-1)
        logp = log_sm.gather(-1, torch.where(valid, y, 0).unsqueeze(-1)).squeeze(-1)
        p = log_sm.exp()
        safe_log_sm = torch.where(p > 0, log_sm, torch.zeros_like(log_sm))
        entropy = -(p * safe_log_sm).sum(dim=-1)
        logp = torch.where(valid, logp, 0.0)
        entropy = torch.where(valid, entropy, 0.0)
        if want_grad:
            total = torch.zeros((), dtype=torch.float64, device=_DEVICE)
            if g1_all is not None:
                total = total + (g1_all[rows] * logp).sum()
            if g2_all is not None:
                total = total + (g2_all[rows] * entropy).sum()
            (grad,) = torch.autograd.grad(total, x)
            out_grad[rows] = grad
        out_logp[rows] = logp.detach()
        out_entropy[rows] = entropy.detach()
    out = {"logp": out_logp.reshape(labels.shape), "entropy": out_entropy.reshape(labels.shape)}
    if want_grad:
        out["grad"] = out_grad.reshape(logits.shape)
    return out


def kl_float64(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    *,
    estimator: str = "k3",
    mask: torch.Tensor | None = None,
    log_ratio_clamp: float | None = 20.0,
    max_value: float | None = 10.0,
    grad_out: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """float64 ``value`` and, given ``grad_out``, ``grad_logp`` and ``grad_ref``."""
    a = logp.detach().to(_DEVICE, torch.float64).clone().requires_grad_(grad_out is not None)
    b = ref_logp.detach().to(_DEVICE, torch.float64).clone().requires_grad_(grad_out is not None)
    keep = None if mask is None else mask.detach().to(_DEVICE) != 0
    d = b - a
    if keep is not None:
        d = torch.where(keep, d, 0.0)
    if estimator == "k1":
        value = -d
    elif estimator == "k2":
        value = d.square() / 2
    elif estimator == "k3":
        dc = d if log_ratio_clamp is None else d.clamp(-log_ratio_clamp, log_ratio_clamp)
        value = dc.exp() - dc - 1
        if max_value is not None:
            value = value.clamp(max=max_value)
    else:
        raise ValueError(f"unknown estimator {estimator!r}")
    if keep is not None:
        value = torch.where(keep, value, 0.0)
    out = {"value": value.detach()}
    if grad_out is not None:
        ga, gb = torch.autograd.grad((value * grad_out.detach().to(_DEVICE, torch.float64)).sum(), (a, b))
        out["grad_logp"], out["grad_ref"] = ga, gb
    return out


def linear_logprobs_float64(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    grad_logp: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """float64 ``logp``, ``entropy`` and, given upstream gradients, ``grad_hidden``,
    ``grad_weight`` (and ``grad_bias``) of ``logprobs_float64(hidden @ weight.T + bias)``."""
    want = grad_logp is not None or grad_entropy is not None
    h = hidden.detach().to(_DEVICE, torch.float64).requires_grad_(want)
    w = weight.detach().to(_DEVICE, torch.float64).requires_grad_(want)
    b = None if bias is None else bias.detach().to(_DEVICE, torch.float64).requires_grad_(want)
    with torch.enable_grad():
        z = h @ w.T + (b if b is not None else 0.0)
        y = labels.detach().to(_DEVICE).reshape(-1)
        zf = z.reshape(-1, z.shape[-1])
        valid = y != ignore_index
        bad_row = (torch.isnan(zf) | torch.isinf(zf) & (zf > 0)).any(dim=-1, keepdim=True)
        zf = torch.where(bad_row, float("nan"), zf) / temperature
        log_sm = torch.log_softmax(zf, dim=-1)
        logp = torch.where(valid, log_sm.gather(-1, torch.where(valid, y, 0).unsqueeze(-1)).squeeze(-1), 0.0)
        p = log_sm.exp()
        entropy = torch.where(valid, -(p * torch.where(p > 0, log_sm, torch.zeros_like(log_sm))).sum(-1), 0.0)
    out = {"logp": logp.detach().reshape(labels.shape), "entropy": entropy.detach().reshape(labels.shape)}
    if want:
        total = torch.zeros((), dtype=torch.float64, device=_DEVICE)
        if grad_logp is not None:
            total = total + (grad_logp.detach().to(_DEVICE, torch.float64).reshape(-1) * logp).sum()
        if grad_entropy is not None:
            total = total + (grad_entropy.detach().to(_DEVICE, torch.float64).reshape(-1) * entropy).sum()
        inputs = (h, w, z) + ((b,) if b is not None else ())
        grads = torch.autograd.grad(total, inputs)
        out["grad_hidden"], out["grad_weight"], out["grad_logits"] = grads[0], grads[1], grads[2]
        if b is not None:
            out["grad_bias"] = grads[3]
    return out
