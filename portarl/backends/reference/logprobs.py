"""Reference log-probs / entropy: pure PyTorch, row-chunked, fp32 accumulation.

Same math as the Triton kernels (:mod:`portarl.kernels.logprobs`), written with torch ops
so that it runs on any device. Forward keeps O(N) state (logsumexp and entropy per row)
plus one chunk of at most :func:`portarl.backends.rows.chunk_elements` elements at a
time; backward recomputes probabilities chunk by chunk and writes straight into the
N x V gradient, its only N x V allocation. Autograd through plain ``log_softmax`` would
instead keep an N x V fp32 tensor alive between forward and backward.
"""

from __future__ import annotations

import torch

from portarl.backends.rows import chunk_rows, iter_row_chunks


def row_stats(z: torch.Tensor, labels: torch.Tensor, with_entropy: bool):
    """For fp32 rows ``z`` [n, V] and in-range ``labels`` [n]: ``(logp, lse, entropy|None)``.

    lse = m + log(sum exp(z - m)); entropy = log(s) - sum(e * (z - m)) / s with e = exp(z - m),
    relative to the row max m so that large logits do not cancel. A row whose entries are all
    -inf gets shift 0 (not -inf) so that no -inf - -inf appears; such a row yields nan.
    """
    m = z.amax(dim=-1, keepdim=True)
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    centred = z - shift
    e = torch.exp(centred)
    s = e.sum(dim=-1)
    log_s = torch.log(s)
    lse = shift.squeeze(-1) + log_s
    logp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        t = torch.where(e > 0, e * centred, torch.zeros_like(e)).sum(dim=-1)
        entropy = log_s - t / s
    return logp, lse, entropy


def row_grad(z, labels, lse, entropy, g_logp, g_entropy, inv_temperature: float) -> torch.Tensor:
    """fp32 d(loss)/d(logits) for one chunk: (g_logp (onehot - p) - g_H p (log p + H)) / T."""
    logp_all = z - lse.unsqueeze(-1)
    p = torch.exp(logp_all)
    grad = -g_logp.unsqueeze(-1) * p
    grad.scatter_add_(-1, labels.unsqueeze(-1), g_logp.unsqueeze(-1))
    if g_entropy is not None:
        term = g_entropy.unsqueeze(-1) * p * (logp_all + entropy.unsqueeze(-1))
        grad -= torch.where(p > 0, term, torch.zeros_like(term))
    return grad * inv_temperature


class ReferenceLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, inv_temperature, ignore_index, with_entropy):
        n_cols = logits.shape[-1]
        n_rows = labels.numel()
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        logp = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
        lse = torch.zeros_like(logp)
        entropy = torch.zeros_like(logp) if with_entropy else None
        for start, stop, rows in iter_row_chunks(logits, chunk_rows(n_cols)):
            z = rows.float() * inv_temperature
            c_logp, c_lse, c_entropy = row_stats(z, safe_labels[start:stop], with_entropy)
            keep = valid[start:stop]
            logp[start:stop] = torch.where(keep, c_logp, 0.0)
            lse[start:stop] = c_lse
            if with_entropy:
                entropy[start:stop] = torch.where(keep, c_entropy, 0.0)
        ctx.save_for_backward(logits, safe_labels, valid, lse, entropy)
        ctx.inv_temperature = inv_temperature
        ctx.with_entropy = with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, labels, valid, lse, entropy = ctx.saved_tensors
        n_cols = logits.shape[-1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat = grad.view(-1, n_cols)
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        use_entropy = ctx.with_entropy and g_entropy is not None
        for start, stop, rows in iter_row_chunks(logits, chunk_rows(n_cols)):
            z = rows.float() * ctx.inv_temperature
            c_grad = row_grad(
                z,
                labels[start:stop],
                lse[start:stop],
                entropy[start:stop] if use_entropy else None,
                g_logp[start:stop],
                g_entropy[start:stop] if use_entropy else None,
                ctx.inv_temperature,
            )
            keep = valid[start:stop].unsqueeze(-1)
            flat[start:stop] = torch.where(keep, c_grad, 0.0)
        return grad, None, None, None, None


def reference_logprobs(logits, labels, *, temperature, ignore_index, return_entropy):
    logp, entropy = ReferenceLogprobs.apply(logits, labels, 1.0 / temperature, ignore_index, return_entropy)
    return logp, entropy
