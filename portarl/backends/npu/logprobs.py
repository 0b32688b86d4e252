"""NPU log-probs / entropy through ``npu_cross_entropy_loss``, keeping portarl's contract.

What this adds on top of the raw operator, and why:
- chunks fed as fp32 (``loss`` comes back in the input's dtype, so bf16 logits would give
  bf16 log-probs: the GPU-vs-NPU difference this project exists to remove);
- at most 200,000 rows per call (the operator's limit), and fewer when V is large, so the
  [n, V] ``log_prob`` it allocates stays a bounded chunk;
- ignored rows masked here with in-range targets (a negative ignore_index ignores nothing);
- a custom autograd Function: forward keeps no N x V tensor alive; backward recomputes each
  chunk and differentiates the operator's ``loss`` (its only differentiable output), then
  adds the entropy term from the operator's ``log_prob`` with torch ops.
"""

from __future__ import annotations

import torch

from portarl.backends.npu import torch_npu_api
from portarl.backends.rows import chunk_rows, iter_row_chunks


def _chunk_rows(n_cols: int) -> int:
    return chunk_rows(n_cols, max_rows=torch_npu_api.CROSS_ENTROPY_MAX_ROWS)


def _entropy_from_log_prob(log_prob: torch.Tensor) -> torch.Tensor:
    """-sum p log p, with 0 log 0 = 0 and NaN kept (``p > 0`` would drop a NaN)."""
    p = torch.exp(log_prob)
    return -torch.where(p == 0, torch.zeros_like(p), p * log_prob).sum(dim=-1)


def _bad_rows(z: torch.Tensor) -> torch.Tensor:
    """Rows with no distribution (NaN, +inf, or all -inf): NaN by contract, whatever the
    operator makes of them."""
    return torch.isnan(z).any(dim=-1) | torch.isposinf(z).any(dim=-1) | torch.isneginf(z).all(dim=-1)


class NpuLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, inv_temperature, ignore_index, with_entropy):
        n_cols = logits.shape[-1]
        n_rows = labels.numel()
        valid = labels != ignore_index
        target = torch.where(valid, labels, torch.zeros_like(labels))
        logp = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
        entropy = torch.zeros_like(logp) if with_entropy else None
        for start, stop, rows in iter_row_chunks(logits, _chunk_rows(n_cols)):
            z = rows.float() * inv_temperature
            loss, log_prob = torch_npu_api.cross_entropy_loss(z, target[start:stop])
            keep = valid[start:stop]
            bad = _bad_rows(z)
            logp[start:stop] = torch.where(keep, torch.where(bad, float("nan"), -loss.float()), 0.0)
            if with_entropy:
                h = torch.where(bad, float("nan"), _entropy_from_log_prob(log_prob.float()))
                entropy[start:stop] = torch.where(keep, h, 0.0)
            del loss, log_prob
        ctx.save_for_backward(logits, target, valid, entropy)
        ctx.inv_temperature = inv_temperature
        ctx.with_entropy = with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, target, valid, entropy = ctx.saved_tensors
        n_cols = logits.shape[-1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat = grad.view(-1, n_cols)
        if g_logp is None:
            g_logp = torch.zeros(target.shape, dtype=torch.float32, device=logits.device)
        use_entropy = ctx.with_entropy and g_entropy is not None
        for start, stop, rows in iter_row_chunks(logits, _chunk_rows(n_cols)):
            keep = valid[start:stop]
            z = (rows.float() * ctx.inv_temperature).requires_grad_(True)
            with torch.enable_grad():
                loss, log_prob = torch_npu_api.cross_entropy_loss(z, target[start:stop])
                # logp = -loss, so d/dz of sum(g * logp) is the gradient of loss weighted by -g.
                weight = torch.where(keep, -g_logp[start:stop], 0.0).to(loss.dtype)
                (grad_z,) = torch.autograd.grad(loss, z, grad_outputs=weight)
            if use_entropy:
                log_prob = log_prob.detach().float()
                p = torch.exp(log_prob)
                g_h = torch.where(keep, g_entropy[start:stop], 0.0).unsqueeze(-1)
                term = g_h * p * (log_prob + entropy[start:stop].unsqueeze(-1))
                grad_z = grad_z - torch.where(p == 0, torch.zeros_like(term), term)
            flat[start:stop] = torch.where(keep.unsqueeze(-1), grad_z * ctx.inv_temperature, 0.0)
        return grad, None, None, None, None


def npu_logprobs(logits, labels, *, temperature, ignore_index, return_entropy):
    return NpuLogprobs.apply(logits, labels, 1.0 / temperature, ignore_index, return_entropy)
