"""NPU fused linear log-probs: chunked fp32 matmul feeding ``npu_cross_entropy_loss``.

Rows in chunks whose fp32 logits tile [n, V] fits ``PORTARL_CHUNK_ELEMENTS`` (and at most
the operator's 200,000 rows), walked by :mod:`portarl.backends._linear_chunks` (the driver
shared with the cuda backend). Each tile is ``hidden_chunk.float() @ weight_block.float().T``
(weight upcast one vocabulary block at a time, never whole), divided by T, and fed in fp32
to the operator through :mod:`portarl.backends.npu.torch_npu_api` (its outputs come back in
the input's dtype, so fp32 in means fp32 log-probs). Entropy comes from the operator's
``log_prob`` with torch ops. Backward recomputes the tile, differentiates the operator's
``loss`` (its only differentiable output), adds the entropy term, and contracts the tile's
gradient into grad_hidden (per chunk) and an fp32 [V, H] weight-gradient accumulator.
"""

from __future__ import annotations

import torch

from portarl.backends._linear_chunks import ChunkMath, backward_chunks, forward_chunks
from portarl.backends.npu import torch_npu_api
from portarl.backends.npu.logprobs import _bad_rows, _entropy_from_log_prob
from portarl.backends.rows import chunk_elements


def _vocab_block(width: int) -> int:
    return max(1, chunk_elements() // max(1, width))


def _tile(h32, weight, bias, inv_t):
    vocab = weight.shape[0]
    z = torch.empty(h32.shape[0], vocab, dtype=torch.float32, device=h32.device)
    step = _vocab_block(h32.shape[1])
    for v0 in range(0, vocab, step):
        v1 = min(vocab, v0 + step)
        torch.matmul(h32, weight[v0:v1].float().T, out=z[:, v0:v1])
    if bias is not None:
        z += bias.float()
    z *= inv_t
    return z


def _grad_hidden(grad_z, weight):
    out = torch.zeros(grad_z.shape[0], weight.shape[1], dtype=torch.float32, device=grad_z.device)
    step = _vocab_block(weight.shape[1])
    for v0 in range(0, weight.shape[0], step):
        out += grad_z[:, v0 : v0 + step] @ weight[v0 : v0 + step].float()
    return out


class NpuChunkMath(ChunkMath):
    """torch matmuls over fp32 upcasts; a fresh tile per chunk (the backward differentiates it)."""

    @property
    def max_rows(self):
        return torch_npu_api.CROSS_ENTROPY_MAX_ROWS  # read per call: the operator's row limit

    def rows(self, hidden_rows):
        return hidden_rows.float()

    def logits(self, rows, weight, bias, inv_t):
        return _tile(rows, weight, bias, inv_t)

    def grad_hidden(self, grad_z, weight):
        return _grad_hidden(grad_z, weight)

    def accumulate_grad_weight(self, gw32, grad_z, rows):
        gw32.addmm_(grad_z.T, rows)


class NpuLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_t, ignore_index, with_entropy):
        valid = labels != ignore_index
        target = torch.where(valid, labels, 0)
        logp = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros_like(logp) if with_entropy else None

        def row_forward(r0, r1, z):
            loss, log_prob = torch_npu_api.cross_entropy_loss(z, target[r0:r1])
            keep, bad = valid[r0:r1], _bad_rows(z)
            logp[r0:r1] = torch.where(keep, torch.where(bad, float("nan"), -loss.float()), 0.0)
            if with_entropy:
                h = torch.where(bad, float("nan"), _entropy_from_log_prob(log_prob.float()))
                entropy[r0:r1] = torch.where(keep, h, 0.0)

        forward_chunks(NpuChunkMath(), hidden, weight, bias, inv_t, row_forward)
        ctx.save_for_backward(hidden, weight, bias, target, valid, entropy)
        ctx.inv_t, ctx.with_entropy = inv_t, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, target, valid, entropy = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        use_h = ctx.with_entropy and g_entropy is not None

        def row_backward(r0, r1, z):
            keep = valid[r0:r1]
            z.requires_grad_(True)
            with torch.enable_grad():
                loss, log_prob = torch_npu_api.cross_entropy_loss(z, target[r0:r1])
                w_rows = torch.where(keep, -g_logp[r0:r1], 0.0).to(loss.dtype)
                (grad_z,) = torch.autograd.grad(loss, z, grad_outputs=w_rows)
            del z, loss
            if use_h:
                log_prob = log_prob.detach().float()
                p = torch.exp(log_prob)
                g_ent = torch.where(keep, g_entropy[r0:r1], 0.0).unsqueeze(-1)
                term = g_ent * p * (log_prob + entropy[r0:r1].unsqueeze(-1))
                grad_z -= torch.where(p == 0, torch.zeros_like(term), term)
                del p, term
            del log_prob
            grad_z = torch.where(keep.unsqueeze(-1), grad_z, 0.0)
            grad_z *= ctx.inv_t
            return grad_z

        grads = backward_chunks(NpuChunkMath(), hidden, weight, bias, ctx.inv_t, row_backward,
                                ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None)


def npu_linear_logprobs(hidden, weight, bias, labels, *, temperature, ignore_index, return_entropy):
    return NpuLinearLogprobs.apply(hidden, weight, bias, labels, 1.0 / temperature, ignore_index, return_entropy)
