"""Small, fast trainer set-ups on the tiny Qwen2 (CPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the trainer needs transformers (pip install 'portarl[train]')")

from portarl.trainer import GRPOTrainer, TrainConfig, build_from_config  # noqa: E402

FAST = [
    "train.steps=3",
    "train.prompts_per_step=4",
    "train.sft_warmup_steps=0",
    "train.micro_batch_size=8",
    "rollout.group_size=4",
    "rollout.max_new_tokens=3",
    "data.synthetic_size=64",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "optim.lr=1e-3",
]


def fast_config(tmp_path, *overrides: str) -> TrainConfig:
    return TrainConfig.load(None, [*FAST, f"output_dir={tmp_path / 'run'}", *overrides])


@pytest.fixture
def make_trainer(tmp_path):
    def make(*overrides: str) -> GRPOTrainer:
        cfg = fast_config(tmp_path, *overrides)
        model, tokenizer, examples = build_from_config(cfg)
        return GRPOTrainer(model, tokenizer, None, examples, cfg, device="cpu")

    return make
