"""Discriminative reward models: ``rewards: [{model: PATH, name, weight, device, dtype, batch_size}]``.

Any transformers ``AutoModelForSequenceClassification`` directory with one label (TRL's
``reward_funcs`` model id, verl's DisRM, OpenRLHF's ``--reward.model_name_or_path``). Why
portarl loads it and not the user: once, on its own device, batched, in inference mode,
never trained, never checkpointed, and counted by ``portarl plan``
(:mod:`portarl.trainer.memory.reward_models`).

Contract:

- A sample is rendered with the *reward model's* tokenizer: with its chat template, the
  prompt's messages (a plain-text prompt as one user message) and the completion as the
  assistant turn; without a chat template, the prompt's text followed by the completion,
  tokenised with the tokenizer's special tokens. The policy's template plays no part: a
  reward model reads the format it was trained on.
- Scores are the model's one logit at the last real token (transformers' own pooling:
  the last token that is not ``pad_token_id``), computed ``batch_size`` samples at a time,
  right-padded (so each sample keeps the positions it has alone), under
  ``torch.inference_mode``, and returned as Python floats (fp32 from the model's dtype).
- Refused at start, one line naming ``rewards[i].model``: a path that is not a model
  directory, ``num_labels`` != 1, a tokenizer without a pad token where the model's config
  has none either (a batch cannot be pooled), a model class that is not a sequence
  classifier, and a named device this machine lacks.
- The model is held by the :class:`RewardModel` (not by the trainer's ``model``), so it is
  never FSDP-wrapped, never in the optimizer and never in a checkpoint; its parameters do
  not require grad.
- Under torchrun each rank loads its own copy on its device (default) or on ``device``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from portarl.runtime.errors import ConfigError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_BATCH_SIZE = 8


class ScoreFailure(Exception):
    """A model-based reward could not score sample ``index`` (None: the whole batch);
    :class:`~portarl.assets.reward_runner.RewardRunner` turns it into the reward failure
    (:class:`~portarl.assets.reward_runner.RewardError`) naming the reward and the sample."""

    def __init__(self, index: int | None, problem: str):
        super().__init__(problem)
        self.index, self.problem = index, problem


def model_dtype_name(spec_dtype: str | None, precision_dtype: str) -> str:
    """``dtype`` unset: the trainer's ``precision.dtype``, with fp16 read as fp32 (a reward
    model's logit is not loss-scaled)."""
    return spec_dtype or ("bf16" if precision_dtype == "bf16" else "fp32")


def read_model_config(path: str, where: str) -> dict:
    """``config.json`` of the reward model's directory, checked: one label, a sequence
    classifier's architecture (when it names one)."""
    directory = Path(path)
    if not directory.is_dir() or not (directory / "config.json").is_file():
        raise ConfigError(f"{where}.model: {path!r} is not a model directory (no config.json): give the directory of "
                          "a transformers sequence-classification model")
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}.model: {directory / 'config.json'} cannot be read: {err}") from None
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        raise ConfigError(f"{where}.model: {path} has {labels} labels; a reward model has one (num_labels=1: a "
                          "scalar score per sequence)")
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if archs and not any(a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in archs):
        raise ConfigError(f"{where}.model: {path} is a {archs[0]}, not a sequence classifier "
                          "(AutoModelForSequenceClassification with num_labels=1)")
    return config


class RewardModel:
    """A loaded reward model, called as ``fn(prompts, completions, answers)`` (answers unused)."""

    def __init__(self, spec, *, where: str, device: torch.device | str, precision_dtype: str = "fp32"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from portarl.backends.device import DeviceUnavailableError, resolve_device

        config = read_model_config(spec.model, where)
        try:
            self.device = resolve_device(spec.device) if spec.device else torch.device(device)
        except (DeviceUnavailableError, ValueError) as err:
            raise ConfigError(f"{where}.device: {err}") from None
        self.dtype = DTYPES[model_dtype_name(spec.dtype, precision_dtype)]
        self.batch_size = spec.batch_size or DEFAULT_BATCH_SIZE
        self.path = spec.model
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(spec.model)
        except Exception as err:  # noqa: BLE001  (transformers raises many kinds: one line naming the field)
            raise ConfigError(f"{where}.model: the tokenizer of {spec.model} cannot be loaded: "
                              f"{' '.join(str(err).split())[:300]}") from None
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else config.get("pad_token_id")
        if pad is None:
            raise ConfigError(f"{where}.model: {spec.model} has no pad token (tokenizer pad_token and config.json "
                              "pad_token_id unset), so a batch cannot be scored at each sample's last token; set "
                              "pad_token in its tokenizer_config.json")
        self.pad_id = int(pad)
        vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        if vocab is not None and not 0 <= self.pad_id < vocab:  # transformers 5 may invent one past the vocabulary
            raise ConfigError(f"{where}.model: {spec.model}'s pad token id {self.pad_id} is outside its vocabulary "
                              f"({vocab} tokens); set pad_token in its tokenizer_config.json to a token it has")
        self.template = getattr(self.tokenizer, "chat_template", None)
        model = AutoModelForSequenceClassification.from_pretrained(spec.model, dtype=self.dtype)
        model.config.pad_token_id = self.pad_id  # transformers pools at the last token that is not this one
        model.requires_grad_(False)
        self.model = model.to(self.device).eval()

    def parameters_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def render(self, prompt, completion: str) -> list[int]:
        """One sample's ids (module docstring): the reward model's chat template, or text."""
        if isinstance(completion, list):  # the batched form's assistant message
            completion = "".join(m.get("content") or "" for m in completion)
        if self.template is not None:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
            out = self.tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}],
                                                     tokenize=True)
            if not isinstance(out, list):  # transformers >= 5: a BatchEncoding
                out = out["input_ids"]
            return [int(i) for i in out]
        text = prompt if isinstance(prompt, str) else "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
        return list(self.tokenizer(text + completion, add_special_tokens=True)["input_ids"])

    def __call__(self, prompts, completions, answers=None) -> list[float]:
        rows = [self.render(p, c) for p, c in zip(prompts, completions)]
        out: list[float] = []
        for start in range(0, len(rows), self.batch_size):
            out += self.score_ids(rows[start:start + self.batch_size])
        return out

    def score_ids(self, rows: list[list[int]]) -> list[float]:
        """The model's logit for each row of ids, one forward, right-padded."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, :len(r)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return [float(v) for v in logits.float().reshape(len(rows), -1)[:, 0].cpu()]

    def close(self) -> None:
        """Drop the model (its device memory returns to the allocator)."""
        self.model = None


def build_tiny_reward_model(directory: str | Path, *, seed: int = 0, hidden_size: int = 32, layers: int = 2,
                            chat_template: bool = True) -> Path:
    """A tiny Qwen2 sequence classifier with one label and the byte tokenizer of ``tiny-chat``
    (its chat template unless ``chat_template`` is false), saved to ``directory``: for tests
    and the docs' examples, as :func:`portarl.assets.models.build_tiny` is for policies."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from portarl.assets.tokenizer import byte_chat_tokenizer

    tokenizer = byte_chat_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rms_norm_eps=1e-6, num_labels=1, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
