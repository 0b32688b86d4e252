"""Worker of tests/distributed/test_ulysses.py (under torchrun, 2 ranks at SP 2): one GRPO
step whose training forwards run Ulysses under flash varlen attention, through the
trainer (scoring and update, FSDP2, the one-row "varlen" layout flash attention gets).

transformers loads no flash model without flash-attn (none on the CPU), so the model loads
with sdpa, rolls out with it, and every sequence-parallel scoring forward switches its
attention to ``flash_attention_2``, registered as the varlen stand-in of
tests/varlen_standin.py (SDPA per span: not flash-attn, not ``npu_fusion_attention``).
Without activation checkpointing: a backward recomputation would run after the switch
back. Prints the stand-in's calls on rank 0; the test compares the step with one process's.

    torchrun --nproc-per-node 2 ulysses_flash_trainer.py OUT_DIR KEY=VALUE...
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))  # tests/: varlen_standin

from varlen_standin import varlen_standin  # noqa: E402


def main(out: str, sets: list[str]) -> int:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls: list[int] = []
    ALL_ATTENTION_FUNCTIONS.register("flash_attention_2", varlen_standin(calls, check_positions=False))
    from portarl.trainer import GRPOTrainer, TrainConfig, build_from_config
    from portarl.trainer.phases import scoring
    from portarl.trainer.phases.packing import Layout

    cfg = TrainConfig.load(None, overrides=[*sets, f"output_dir={out}"])
    model, tokenizer, examples = build_from_config(cfg)
    trainer = GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")  # installs the SP attention
    trainer.padding_free = Layout("varlen")  # what resolve_padding_free picks for flash: one row per micro-batch
    sp_logprobs = scoring.sp_completion_logprobs

    def under_flash(model, *args, **kwargs):
        model.config._attn_implementation = "flash_attention_2"
        try:
            return sp_logprobs(model, *args, **kwargs)
        finally:
            model.config._attn_implementation = "sdpa"

    scoring.sp_completion_logprobs = under_flash
    try:
        trainer.train()
    finally:
        trainer.close()
    assert calls and max(calls) > 2, calls  # rows of several sequences reached the kernel as spans
    if trainer.dist.is_main:
        print(f"ok flash varlen: {len(calls)} attention calls, up to {max(calls)} spans a row", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
