"""Reference log-probs / entropy: pure PyTorch, row-chunked, fp32 accumulation.

Same math as the Triton kernels (:mod:`portarl.kernels.logprobs`), written with torch ops
so that it runs on any device. Forward keeps O(N) state (logsumexp and entropy per row)
plus one chunk at a time; backward recomputes probabilities chunk by chunk and writes
straight into the N x V gradient, its only N x V allocation. Autograd through plain
``log_softmax`` would instead keep an N x V fp32 tensor alive between forward and backward.

Speed on a CPU comes from memory traffic, not flops (issue 17):
- chunks are cache-sized (:func:`portarl.backends.rows.cpu_chunk_elements`, 4 MiB of fp32)
  rather than the accelerators' 64 MiB: a 64 MiB temporary is larger than the L3 cache and
  above glibc's mmap threshold, so each one was a fresh, page-faulting mmap;
- the work buffers are allocated once per call and reused for every chunk, and every step
  is an in-place or ``out=`` op: the forward is max, subtract, exp, sum over one fp32 copy
  of the chunk (one logsumexp pass; the entropy adds one multiply-sum over the same two
  buffers), the backward builds the gradient in one buffer (the gradient slice itself for
  fp32) with in-place ops, the way Liger-Kernel reuses its logits buffer for the gradient.
The formulas, including the treatment of -inf, +inf and NaN, are those of :func:`row_stats`
and :func:`row_grad` (kept as the readable statement of the math and for other modules).
"""

from __future__ import annotations

import torch

from portarl.backends.rows import chunk_elements, chunk_rows, cpu_chunk_elements, iter_row_chunks


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


#: Centred logits below this give exp() == 0 exactly in fp32 (exp(-104) underflows), so
#: clamping there changes no probability, and turns 0 * -inf (nan) into 0 * finite (0).
_FLOOR = -1.0e4


def _rows_per_chunk(logits: torch.Tensor) -> int:
    budget = cpu_chunk_elements() if logits.device.type == "cpu" else chunk_elements()
    return chunk_rows(logits.shape[-1], elements=budget)


def _work(rows_per_chunk: int, n_rows: int, n_cols: int, device) -> torch.Tensor:
    return torch.empty(min(rows_per_chunk, max(n_rows, 1)), n_cols, dtype=torch.float32, device=device)


def chunk_stats_(z, e, labels, with_entropy: bool):
    """:func:`row_stats` computed in two caller-owned fp32 buffers; ``z`` is overwritten.

    ``z`` [n, V] holds the scaled logits, ``e`` [n, V] is scratch. Allocates only O(n).
    """
    picked = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    m = z.amax(dim=-1, keepdim=True)
    shift = m.masked_fill_(m == float("-inf"), 0.0)
    centred = z.sub_(shift)
    torch.exp(centred, out=e)
    s = e.sum(dim=-1)
    log_s = torch.log(s)
    lse = shift.squeeze(-1) + log_s
    logp = picked - lse
    entropy = None
    if with_entropy:
        # e * (z - m) is 0 where e is 0, also for z = -inf; the floor keeps NaN (clamp propagates it).
        t = e.mul_(centred.clamp_min_(_FLOOR)).sum(dim=-1)
        entropy = log_s - t / s
    return logp, lse, entropy


def chunk_grad_(z, out, labels, lse, entropy, g_logp, g_entropy, inv_temperature: float, keep):
    """:func:`row_grad` built in place: ``z`` [n, V] (scaled fp32 logits, overwritten) and
    ``out`` [n, V] fp32 (receives the gradient; may be the caller's gradient slice).

    Rows where ``keep`` is False get 0 whatever the logits hold.
    """
    logp_all = z.sub_(lse.unsqueeze(-1))
    p = torch.exp(logp_all, out=out)
    g = g_logp.unsqueeze(-1)
    if g_entropy is not None:
        # g_logp + g_H (log p + H), then times -p: the floor only touches entries with p == 0.
        coef = logp_all.clamp_min_(_FLOOR).add_(entropy.unsqueeze(-1)).mul_(g_entropy.unsqueeze(-1)).add_(g)
        grad = p.mul_(coef).neg_()
    else:
        grad = p.mul_(-g)
    grad.scatter_add_(-1, labels.unsqueeze(-1), g)
    if inv_temperature != 1.0:
        grad.mul_(inv_temperature)
    return grad.masked_fill_(~keep.unsqueeze(-1), 0.0)


def _load(buf, rows, inv_temperature):
    z = buf[: rows.shape[0]]
    z.copy_(rows)
    if inv_temperature != 1.0:
        z.mul_(inv_temperature)
    return z


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
        step = _rows_per_chunk(logits)
        z_buf = _work(step, n_rows, n_cols, logits.device)
        e_buf = torch.empty_like(z_buf)
        for start, stop, rows in iter_row_chunks(logits, step):
            z = _load(z_buf, rows, inv_temperature)
            c_logp, c_lse, c_entropy = chunk_stats_(z, e_buf[: stop - start], safe_labels[start:stop], with_entropy)
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
        step = _rows_per_chunk(logits)
        z_buf = _work(step, labels.numel(), n_cols, logits.device)
        # fp32 gradients are built in their final place; other dtypes in one reused buffer.
        in_place = grad.dtype == torch.float32
        g_buf = None if in_place else torch.empty_like(z_buf)
        for start, stop, rows in iter_row_chunks(logits, step):
            z = _load(z_buf, rows, ctx.inv_temperature)
            out = flat[start:stop] if in_place else g_buf[: stop - start]
            chunk_grad_(
                z,
                out,
                labels[start:stop],
                lse[start:stop],
                entropy[start:stop] if use_entropy else None,
                g_logp[start:stop],
                g_entropy[start:stop] if use_entropy else None,
                ctx.inv_temperature,
                valid[start:stop],
            )
            if not in_place:
                flat[start:stop].copy_(out)
        return grad, None, None, None, None


def reference_logprobs(logits, labels, *, temperature, ignore_index, return_entropy):
    logp, entropy = ReferenceLogprobs.apply(logits, labels, 1.0 / temperature, ignore_index, return_entropy)
    return logp, entropy
