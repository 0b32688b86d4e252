"""Reference fused linear log-probs: pure PyTorch, tiled over (row chunk x vocabulary block).

Logits ``z = (hidden @ weight.T + bias) / T`` are never held whole. The vocabulary is walked
in blocks of ``block_v`` columns (outer loop, so each weight block is upcast to fp32 once per
pass) and the rows in chunks of ``block_n`` (inner loop), with ``block_n * block_v`` at most
:func:`portarl.backends.rows.chunk_elements`. Each tile is an fp32 matmul of fp32-upcast
inputs (products of bf16/fp16 values are exact in fp32), folded into per-row online
statistics exactly as the Triton row kernel does (running max m, s = sum exp(z - m),
t = sum exp(z - m) (z - m), the label's logit).

Backward recomputes every tile and turns it into its logits gradient in place, then
  grad_hidden (fp32 [N, H] accumulator) += grad_z @ weight_block,
  grad_weight_block (fp32 [block_v, H])  += grad_z.T @ hidden_chunk   (over row chunks),
each weight block's fp32 gradient cast once to the weight's dtype when complete.

Extra memory: one fp32 [N, H] copy of hidden and one fp32 [N, H] gradient accumulator
(hidden-sized), O(N) row statistics, and tiles bounded by the chunk budget. Never N x V,
never an fp32 copy of the whole weight.
"""

from __future__ import annotations

import torch

from portarl.backends.rows import chunk_elements

_NEG_INF = float("-inf")


def tile_shape(n_rows: int, vocab: int, hidden: int) -> tuple[int, int]:
    """``(block_n, block_v)`` with block_n * block_v and block_v * hidden within the budget."""
    budget = chunk_elements()
    block_n = max(1, min(n_rows, budget // min(vocab, 256)))
    block_v = max(1, min(vocab, budget // block_n, max(1, budget // max(1, hidden))))
    return block_n, block_v


def _tile(h32_rows, w32, b32, inv_t):
    z = h32_rows @ w32.T
    if b32 is not None:
        z += b32
    z *= inv_t
    return z


def _forward_stats(h32, weight, bias, labels, inv_t, with_entropy):
    n_rows, vocab = h32.shape[0], weight.shape[0]
    block_n, block_v = tile_shape(n_rows, vocab, h32.shape[1])
    dev = h32.device
    m = torch.full((n_rows,), _NEG_INF, dtype=torch.float32, device=dev)
    s = torch.zeros(n_rows, dtype=torch.float32, device=dev)
    t = torch.zeros_like(s) if with_entropy else None
    z_label = torch.zeros_like(s)
    for v0 in range(0, vocab, block_v):
        v1 = min(vocab, v0 + block_v)
        w32 = weight[v0:v1].float()
        b32 = bias[v0:v1].float() if bias is not None else None
        for r0 in range(0, n_rows, block_n):
            r1 = min(n_rows, r0 + block_n)
            z = _tile(h32[r0:r1], w32, b32, inv_t)
            lab = labels[r0:r1]
            here = (lab >= v0) & (lab < v1)
            picked = z.gather(-1, torch.where(here, lab - v0, 0).unsqueeze(-1)).squeeze(-1)
            z_label[r0:r1] = torch.where(here, picked, z_label[r0:r1])
            m_old, s_old = m[r0:r1], s[r0:r1]
            m_new = torch.maximum(m_old, z.amax(dim=-1))
            shift = torch.where(m_new == _NEG_INF, 0.0, m_new)
            scale = torch.exp(m_old - shift)
            z -= shift.unsqueeze(-1)  # z is now z - shift; e below reuses no extra tile
            e = torch.exp(z)
            if with_entropy:
                tile_t = torch.where(e > 0, e * z, 0.0).sum(dim=-1)
                moved = torch.where(s_old > 0, (m_old - shift) * s_old, 0.0)
                t[r0:r1] = scale * (t[r0:r1] + moved) + tile_t
            s[r0:r1] = s_old * scale + e.sum(dim=-1)
            m[r0:r1] = m_new
            del z, e
    shift = torch.where(m == _NEG_INF, 0.0, m)
    log_s = torch.log(s)
    lse = shift + log_s
    entropy = log_s - t / s if with_entropy else None
    return z_label - lse, lse, entropy


class ReferenceLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_t, ignore_index, with_entropy):
        valid = labels != ignore_index
        safe = torch.where(valid, labels, 0)
        h32 = hidden.float()
        logp, lse, entropy = _forward_stats(h32, weight, bias, safe, inv_t, with_entropy)
        logp = torch.where(valid, logp, 0.0)
        if with_entropy:
            entropy = torch.where(valid, entropy, 0.0)
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse, entropy)
        ctx.inv_t, ctx.with_entropy = inv_t, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, labels, valid, lse, entropy = ctx.saved_tensors
        inv_t = ctx.inv_t
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        g_logp = torch.zeros_like(lse) if g_logp is None else torch.where(valid, g_logp, 0.0)
        use_h = ctx.with_entropy and g_entropy is not None
        g_h = torch.where(valid, g_entropy, 0.0) if use_h else None
        lse = torch.where(valid, lse, 0.0)
        h32 = hidden.float()
        grad_h32 = torch.zeros_like(h32) if want_h else None
        grad_w = torch.empty_like(weight) if want_w else None
        grad_b = torch.empty_like(bias) if want_b else None
        block_n, block_v = tile_shape(n_rows, vocab, hidden.shape[1])
        keep = valid.unsqueeze(-1)
        for v0 in range(0, vocab, block_v):
            v1 = min(vocab, v0 + block_v)
            w32 = weight[v0:v1].float()
            b32 = bias[v0:v1].float() if bias is not None else None
            gw32 = torch.zeros_like(w32) if want_w else None
            gb32 = torch.zeros(v1 - v0, dtype=torch.float32, device=w32.device) if want_b else None
            for r0 in range(0, n_rows, block_n):
                r1 = min(n_rows, r0 + block_n)
                grad = _tile(h32[r0:r1], w32, b32, inv_t)
                grad -= lse[r0:r1].unsqueeze(-1)  # log p, in place
                logp_all = grad.clone() if use_h else None
                grad.exp_()  # p
                if use_h:
                    logp_all += entropy[r0:r1].unsqueeze(-1)
                    logp_all.mul_(grad).mul_(g_h[r0:r1].unsqueeze(-1))
                    term = torch.where(grad > 0, logp_all, 0.0)
                    del logp_all
                grad.mul_(-g_logp[r0:r1].unsqueeze(-1))
                if use_h:
                    grad -= term
                    del term
                lab = labels[r0:r1]
                here = (lab >= v0) & (lab < v1)
                grad.scatter_add_(-1, torch.where(here, lab - v0, 0).unsqueeze(-1),
                                  torch.where(here, g_logp[r0:r1], 0.0).unsqueeze(-1))
                grad = torch.where(keep[r0:r1], grad, 0.0)
                grad *= inv_t
                if want_h:
                    grad_h32[r0:r1].addmm_(grad, w32)
                if want_w:
                    gw32.addmm_(grad.T, h32[r0:r1])
                if want_b:
                    gb32 += grad.sum(dim=0)
                del grad
            if want_w:
                grad_w[v0:v1] = gw32
            if want_b:
                grad_b[v0:v1] = gb32
        grad_hidden = grad_h32.to(hidden.dtype) if want_h else None
        return grad_hidden, grad_w, grad_b, None, None, None, None


def reference_linear_logprobs(hidden, weight, bias, labels, *, temperature, ignore_index, return_entropy):
    """``hidden`` [N, H], ``weight`` [V, H], ``bias`` [V] or None, ``labels`` int64 [N] (validated)."""
    return ReferenceLinearLogprobs.apply(hidden, weight, bias, labels, 1.0 / temperature, ignore_index, return_entropy)
