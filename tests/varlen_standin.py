"""A stand-in for transformers' flash varlen attention, for tests on the CPU (no flash-attn,
no Ascend here): ``flash_attn_varlen_func``'s contract, causal attention within each
``[cu[i], cu[i+1])`` span of the flattened rows, built from SDPA per span. Not flash-attn and
not ``npu_fusion_attention`` (which transformers calls with the same cumulative lengths as
``actual_seq_qlen`` on Ascend): it checks that the cumulative lengths reach the attention
call and are right. Registered in place of ``ALL_ATTENTION_FUNCTIONS["flash_attention_2"]``.
"""

from __future__ import annotations

import torch


def varlen_standin(calls: list, check_positions: bool = True):
    """The attention function (transformers' signature). Each call appends its span count to
    ``calls``. With ``check_positions`` the spans must be the ones transformers derives from
    the call's ``position_ids`` (the trainer's one-row varlen layout passes both)."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
        assert attention_mask is None, "varlen attention takes spans, not a mask"
        assert kwargs["cu_seq_lens_k"] is cu and kwargs["max_length_k"] == max_len
        if check_positions:
            from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

            (want_cu, _), (want_max, _) = prepare_fa_kwargs_from_position_ids(kwargs["position_ids"])
            assert query.shape[0] == 1
            assert cu.tolist() == want_cu.tolist() and max_len == int(want_max), (cu, want_cu, max_len, want_max)
        rows, heads, width, dim = query.shape
        assert int(cu[-1]) == rows * width and int((cu[1:] - cu[:-1]).max()) == max_len, (cu, rows, width, max_len)
        calls.append(len(cu) - 1)
        flat = [t.transpose(1, 2).reshape(rows * width, t.shape[1], dim).transpose(0, 1) for t in (query, key, value)]
        out = torch.empty_like(flat[0])
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            out[:, a:b] = torch.nn.functional.scaled_dot_product_attention(
                flat[0][:, a:b], flat[1][:, a:b], flat[2][:, a:b], is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(0, 1).reshape(rows, width, heads, dim), None

    return attention
