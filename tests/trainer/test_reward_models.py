"""Reward models (issue 50): a tiny sequence classifier saved to a directory scores
completions through the config exactly as calling it by hand does; it is refused at start
when it cannot work; it is never trained, never in the optimizer, never checkpointed; and
``portarl plan`` counts it."""

from __future__ import annotations

import pytest
import torch

from portarl.assets.data import Example
from portarl.assets.reward_models import build_tiny_reward_model
from portarl.assets.reward_runner import RewardRunner
from portarl.parity.tolerances import FP32_ACCUM_ATOL
from portarl.runtime.errors import ConfigError
from portarl.trainer.config import TrainConfig

ROWS = [Example("1+1=", "2", {"answer": "2"}, "d.jsonl:1"),
        Example(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}), "4", {}, "d.jsonl:2")]
TEXTS = ["2", "The answer is 3.", "4", "five, I think"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm")


def _rows():
    return [ROWS[i // 2] for i in range(len(TEXTS))]


def _by_hand(directory, rows, texts) -> list[float]:
    """The reward model called as its model card says: its own chat template, one sample at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    out = []
    for ex, text in zip(rows, texts):
        prompt = [{"role": "user", "content": ex.prompt}] if isinstance(ex.prompt, str) else list(ex.prompt)
        ids = tok.apply_chat_template(prompt + [{"role": "assistant", "content": text}], return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def _runner(*specs: str) -> RewardRunner:
    return RewardRunner(TrainConfig.load(None, [f"rewards=[{', '.join(specs)}]", "precision.dtype=fp32"]).rewards)


def test_a_reward_model_scores_as_calling_it_by_hand(rm_dir):
    want = _by_hand(rm_dir, _rows(), TEXTS)
    assert len(set(want)) == len(want)  # the completions score differently: the comparison can tell them apart
    one = _runner(f"{{model: '{rm_dir}', batch_size: 1, weight: 2.0}}").score(_rows(), TEXTS)
    assert one.per_function["tiny-rm"] == want  # one sample per forward: bitwise
    assert one.total.tolist() == pytest.approx([2 * v for v in want], rel=1e-6)
    assert one.metrics["reward/tiny-rm"] == pytest.approx(sum(want) / len(want))
    batched = _runner(f"{{model: '{rm_dir}', batch_size: 3}}").score(_rows(), TEXTS).per_function["tiny-rm"]
    scale = max(abs(v) for v in want)  # right-padded batches: each sample keeps its positions
    assert batched == pytest.approx(want, rel=0, abs=FP32_ACCUM_ATOL * (1 + scale))


def test_the_reward_models_template_renders_the_conversation_not_plain_text(rm_dir, tmp_path):
    """The same weights without a chat template read the prompt's text and the completion:
    other scores, so the equality above depends on the template being the reward model's."""
    plain = build_tiny_reward_model(tmp_path / "plain", chat_template=False)
    with_template = _runner(f"{{model: '{rm_dir}'}}").score(_rows(), TEXTS).per_function["tiny-rm"]
    without = _runner(f"{{model: '{plain}'}}").score(_rows(), TEXTS).per_function["plain"]
    assert all(abs(a - b) > 1e-4 for a, b in zip(with_template, without))


def test_rewards_of_every_kind_sum_with_their_weights(rm_dir):
    def longer(prompts, completions, **columns):
        return [float(len(c)) for c in completions]

    rm = RewardRunner(TrainConfig.load(None, [f"rewards=[{{model: '{rm_dir}'}}]"]).rewards).functions[0]
    runner = RewardRunner([("math_exact", 0.5), (longer, 0.25)])
    runner.functions.append(rm)
    scores = runner.score(_rows(), TEXTS)
    got = scores.per_function
    assert set(got) == {"math_exact", "longer", "tiny-rm"}
    want = [0.5 * a + 0.25 * b + c for a, b, c in zip(got["math_exact"], got["longer"], got["tiny-rm"])]
    assert scores.total.tolist() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("problem, expected", [
    ("not_a_dir", "is not a model directory (no config.json)"),
    ("two_labels", "has 2 labels; a reward model has one"),
    ("no_pad", "pad token"),  # none at all, or (transformers 5) one it invents past the vocabulary
    ("causal_lm", "is a Qwen2ForCausalLM, not a sequence classifier"),
])
def test_a_reward_model_that_cannot_work_is_refused_at_start_in_one_line(tmp_path, problem, expected):
    import json

    directory = build_tiny_reward_model(tmp_path / "rm")
    config = json.loads((directory / "config.json").read_text())
    if problem == "not_a_dir":
        directory = tmp_path / "missing"
    elif problem == "two_labels":
        config["id2label"], config["label2id"] = {"0": "a", "1": "b"}, {"a": 0, "b": 1}
        config["num_labels"] = 2
    elif problem == "no_pad":
        config["pad_token_id"] = None
        tok = json.loads((directory / "tokenizer_config.json").read_text())
        tok.pop("pad_token", None)
        (directory / "tokenizer_config.json").write_text(json.dumps(tok))
    else:
        config["architectures"] = ["Qwen2ForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config)) if directory.exists() else None
    specs = TrainConfig.load(None, [f"rewards=[{{name: math_exact}}, {{model: '{directory}'}}]"]).rewards
    with pytest.raises(ConfigError) as err:
        RewardRunner(specs)
    message = str(err.value)
    assert message.startswith("rewards[1].model: ") and expected in message and "\n" not in message, message


@pytest.mark.parametrize("setting, expected", [
    ("{model: M, dtype: fp16}", "rewards[0].dtype must be bf16 or fp32"),
    ("{model: M, timeout_s: 3}", "rewards[0].timeout_s is a judge's (judge: URL) setting, and this reward is a model"),
    ("{name: math_exact, batch_size: 2}", "rewards[0].batch_size is a reward model's (model: PATH) setting"),
    ("{judge: 'localhost:8000', model: m}", "rewards[0].judge must be an http:// or https:// URL"),
    ("{judge: 'http://h:1', model: m, parse: middle}", "rewards[0].parse must be number, first_number, last_number"),
    ("{name: math_exact}, {name: math_exact}", "rewards[1].name 'math_exact' is also rewards[0]'s"),
])
def test_reward_settings_are_checked_with_the_field_named(setting, expected):
    with pytest.raises(ConfigError, match=None) as err:
        TrainConfig.load(None, [f"rewards=[{setting}]"])
    assert str(err.value).startswith(expected), str(err.value)


def test_a_reward_model_is_never_trained_in_the_optimizer_or_checkpointed(make_trainer, rm_dir):
    from safetensors import safe_open

    trainer = make_trainer(f"rewards=[{{model: '{rm_dir}'}}, {{name: math_exact}}]", "train.steps=1",
                           "checkpoint.every=1")
    [rm] = trainer.rewards.reward_models()
    before = {k: v.clone() for k, v in rm.model.state_dict().items()}
    trainer.train()
    assert all(not p.requires_grad for p in rm.model.parameters())
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not in_optimizer & {id(p) for p in rm.model.parameters()}
    assert all(torch.equal(before[k], v) for k, v in rm.model.state_dict().items())
    latest = trainer.checkpoints.latest()
    with safe_open(str(latest / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert saved <= set(trainer.model.state_dict()) and "score.weight" not in saved  # the policy's (tied head left out)
    trainer.close()


def test_portarl_plan_counts_the_reward_model(rm_dir):
    from portarl.trainer.memory.plan import estimate_for_config

    base = TrainConfig.load(None, ["rewards=[{name: math_exact}]"])
    with_rm = TrainConfig.load(None, [f"rewards=[{{name: math_exact}}, {{model: '{rm_dir}', dtype: bf16}}]"])
    plan = estimate_for_config(with_rm)
    params = sum(p.numel() for p in RewardRunner(with_rm.rewards).reward_models()[0].model.parameters())
    assert plan.parts["reward model tiny-rm"] == 2 * params
    assert plan.static - estimate_for_config(base).static == 2 * params


def test_in_async_mode_the_trainer_leaves_the_reward_model_to_the_worker(make_trainer, rm_dir):
    """The worker scores (and loads it); the trainer's copy would double its memory. It loads
    at a first score of its own (eval.data), and is then the same model."""
    trainer = make_trainer(f"rewards=[{{model: '{rm_dir}'}}]", "rollout.mode=async")
    try:
        assert trainer.rewards.reward_models() == []
        scores = trainer.rewards.score([ROWS[0]], ["2"])
        [rm] = trainer.rewards.reward_models()
        assert scores.per_function["tiny-rm"] == _by_hand(rm_dir, [ROWS[0]], ["2"])
    finally:
        trainer.close()
