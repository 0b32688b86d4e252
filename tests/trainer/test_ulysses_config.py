"""Ulysses sequence parallelism without processes: what is refused at start (one line naming
the setting), the whole row's attention mask, the GQA repeat, the per-rank token budget.
The numerics over Gloo: tests/distributed/test_ulysses.py."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")

from portarl.trainer.config import ConfigError, TrainConfig  # noqa: E402
from portarl.trainer.phases.micro_batches import micro_batches  # noqa: E402
from portarl.trainer.phases.sequences import build_batch  # noqa: E402
from portarl.trainer.phases.ulysses import kv_repeat, row_mask, row_spans, sequence_parallel_refusal  # noqa: E402
from portarl.trainer.start.setup import check_distributed_config  # noqa: E402


def _cfg(size: int, **sets) -> TrainConfig:
    cfg = TrainConfig()
    cfg.train.sequence_parallel_size = size
    for key, value in sets.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg.validate()


@pytest.fixture(scope="module")
def tiny():
    from portarl.assets.models import build_tiny

    model, _ = build_tiny(hidden_size=32, intermediate_size=64)  # 4 query heads, 2 key / value heads, sdpa
    return model


def test_size_one_is_off_and_a_supported_setup_passes(tiny):
    assert sequence_parallel_refusal(_cfg(1), tiny, 1) is None
    assert sequence_parallel_refusal(_cfg(2), tiny, 2) is None
    assert sequence_parallel_refusal(_cfg(4), tiny, 8) is None  # kv 2 < SP 4: each kv head repeated twice
    with pytest.raises(ConfigError, match="train.sequence_parallel_size"):
        _cfg(0)


@pytest.mark.parametrize("size, world, words", [
    (2, 1, "needs torchrun"),
    (4, 6, "must divide the 6 ranks"),
    (8, 8, "num_attention_heads=4 is not a multiple"),
])
def test_refused_with_one_line(tiny, size, world, words):
    why = sequence_parallel_refusal(_cfg(size), tiny, world)
    assert why is not None and words in why and f"train.sequence_parallel_size={size}" in why and "\n" not in why


@pytest.mark.parametrize("heads, kv, size", [(4, 2, 4), (6, 2, 3), (12, 4, 6), (8, 1, 8), (12, 6, 4), (6, 3, 2)])
def test_gqa_kv_heads_are_repeated_to_keep_each_query_head_with_its_own(tiny, monkeypatch, heads, kv, size):
    """Rank j holds query heads [j h / SP, (j + 1) h / SP) and, after the repeat, kv' heads
    [j kv' / SP, ...); its local query head a must meet the kv head the whole model gives it."""
    monkeypatch.setattr(tiny.config, "num_attention_heads", heads)
    monkeypatch.setattr(tiny.config, "num_key_value_heads", kv)
    assert sequence_parallel_refusal(_cfg(size), tiny, size) is None
    repeat = kv_repeat(kv, size)
    kv_global = torch.arange(kv).repeat_interleave(repeat)  # original kv head of each repeated one
    for j in range(size):
        q_heads = range(j * heads // size, (j + 1) * heads // size)
        local_kv = kv_global.chunk(size)[j].repeat_interleave(len(q_heads) // (len(kv_global) // size))
        assert [int(h) for h in local_kv] == [q // (heads // kv) for q in q_heads]


@pytest.mark.parametrize("sets, words", [
    ({"rollout__engine": "vllm"}, "rollout.engine=vllm"),
    ({"rollout__mode": "async"}, "rollout.mode=async"),
    ({"precision__numerics": "npu-emulated"}, "precision.numerics"),
])
def test_unsupported_combinations_are_refused(tiny, sets, words):
    why = sequence_parallel_refusal(_cfg(2, **sets), tiny, 2)
    assert why is not None and words in why and why.endswith("set train.sequence_parallel_size=1")


def test_attention_the_wrapper_cannot_reach_is_refused(tiny, monkeypatch):
    for impl in ("eager", "flex_attention"):
        monkeypatch.setattr(tiny.config, "_attn_implementation", impl)
        assert f"model.attn_implementation='{impl}'" in sequence_parallel_refusal(_cfg(2), tiny, 2)
    monkeypatch.setattr(tiny.config, "_attn_implementation", "flash_attention_2")  # varlen: wrapped
    assert sequence_parallel_refusal(_cfg(2), tiny, 2) is None


def test_spans_built_for_varlen_never_run_as_plain_causal_sdpa():
    from portarl.trainer.phases.ulysses import _RowAttention

    positions = torch.tensor([[0, 1, 0, 1]])
    rows = _RowAttention(types.SimpleNamespace(size=1), 4, None, row_spans(positions, None))
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="built for varlen attention"):
        rows.attend(q, q, q)


def test_row_spans_are_the_sequences_and_the_padding_runs():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])  # two sequences and SP's tail; one
    cu, longest, flat = row_spans(positions, None)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 12] and longest == 6
    assert flat.shape == (1, 12)
    # Padding whose positions run on into the real tokens is still a span of its own
    valid = torch.tensor([[False, False, True, True, True, False]])
    cu, longest, _ = row_spans(torch.arange(6)[None], valid)
    assert cu.tolist() == [0, 2, 5, 6] and longest == 3


def test_prompts_split_per_data_parallel_group():
    check_distributed_config(_cfg(2, train__prompts_per_step=2), 4)  # 2 groups of 2 ranks
    with pytest.raises(ConfigError, match="2 data-parallel groups"):
        check_distributed_config(_cfg(2, train__prompts_per_step=3), 4)


def test_row_mask_is_causal_within_sequences_over_real_keys():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])  # two sequences, then a padding segment
    mask = row_mask(positions, None, None)[0, 0]
    seg = torch.tensor([0, 0, 0, 1, 1, 2])
    want = torch.ones(6, 6).tril().bool() & (seg[:, None] == seg[None, :])
    assert torch.equal(mask, want)
    assert row_mask(torch.arange(5)[None], None, None) is None  # one sequence, no padding: plain causal
    assert row_mask(torch.tensor([[0, 1, 2, 0]]), None, None, real_width=3) is None  # SP's padding trails
    assert row_mask(torch.tensor([[0, 1, 0, 1]]), None, None, real_width=3) is not None
    left_padded = torch.tensor([[0, 0, 0, 1, 2]])
    valid = torch.tensor([[False, False, True, True, True]])
    mask = row_mask(left_padded, valid, None)[0, 0]
    assert torch.equal(mask[4], torch.tensor([False, False, True, True, True]))
    assert bool(mask.diagonal().all())  # a padding query attends to itself: finite, read by nothing
    shared = torch.tensor([[[[True, False], [True, True]]]])
    mask = row_mask(torch.zeros(1, 4, dtype=torch.long), None, shared)[0, 0]
    assert torch.equal(mask[:2, :2], shared[0, 0]) and torch.equal(mask[2:, 2:], torch.eye(2, dtype=torch.bool))


def test_the_token_budget_is_per_rank():
    batch = build_batch([[5, 6]] * 4, [[1, 2, 3]] * 4, 0, "cpu")
    train = types.SimpleNamespace(micro_batch_size=64, max_tokens_per_micro_batch=10)
    trainer = types.SimpleNamespace(config=types.SimpleNamespace(train=train), dist=types.SimpleNamespace(enabled=False),
                                    sp=None)
    assert len(micro_batches(trainer, batch)) == 2  # 5 tokens a row: 2 rows per 10
    trainer.sp = types.SimpleNamespace(size=2)
    assert len(micro_batches(trainer, batch)) == 1  # each rank computes half of every row: 4 rows per 2 x 10


def test_plan_shows_the_per_rank_peak_falling_with_the_sequence_parallel_size():
    from portarl.trainer.memory.arch import arch_of
    from portarl.trainer.memory.plan import estimate
    from portarl.trainer.memory.report import render

    # One 8k-token sequence per micro-batch (micro_batch_size=1): what a rank holds falls with SP.
    # (Bound by the budget instead, a group's micro-batch takes SP x the rows: the same tokens per rank.)
    sets = ["rollout.max_new_tokens=8192", "train.prompts_per_step=4", "rollout.group_size=2",
            "train.micro_batch_size=1", "train.gradient_checkpointing=false"]
    plans = {}
    for size in (1, 2, 4):
        cfg = TrainConfig.load(None, [*sets, f"train.sequence_parallel_size={size}"])
        plans[size] = estimate(cfg, arch_of(cfg.model), prompt_tokens=8, devices=4)
    for size in (2, 4):  # the same rows per group: activations per rank / SP, one mask of the group's rows
        assert plans[size].micro_batch_tokens == -(-plans[1].micro_batch_tokens // size)
        budget_bound = estimate(TrainConfig.load(None, [*sets, "train.micro_batch_size=64",
                                                        "train.max_tokens_per_micro_batch=8200",
                                                        f"train.sequence_parallel_size={size}"]),
                                arch_of(cfg.model), prompt_tokens=8, devices=4)
        assert budget_bound.micro_batch_tokens == 8200
        assert plans[size].parts["saved activations"] < plans[1].parts["saved activations"] / (size - 0.5)
        assert plans[size].parts["attention mask (sequence parallel)"] == 0  # one sequence: plain causal
    assert plans[4].peak < plans[2].peak < plans[1].peak
    assert "sequence parallel 2 (Ulysses)" in render(plans[2], TrainConfig.load(None, sets))
