"""Small, fast trainer set-ups on the tiny Qwen2 (CPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the trainer needs transformers (pip install 'portarl[train]')")

from portarl.trainer import GRPOTrainer, build_from_config  # noqa: E402
from trainer_fast import fast_config  # noqa: E402


@pytest.fixture
def make_trainer(tmp_path):
    def make(*overrides: str, rewards=None) -> GRPOTrainer:
        """``rewards``: reward functions (default: the config's, math_exact and format)."""
        cfg = fast_config(tmp_path, *overrides)
        model, tokenizer, examples = build_from_config(cfg)
        return GRPOTrainer(model, tokenizer, rewards, examples, cfg, device="cpu")

    return make
