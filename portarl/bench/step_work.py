"""The work of one ``portarl bench step`` run: which model, how many samples, how they are
split, and how the same work is spelled in TRL's GRPOConfig.

Two kinds of work:

* without ``--model`` (the default, unchanged so earlier results keep their meaning): the
  tiny Qwen2 built from a config and a character tokenizer, 8 prompts x 8 samples, 8 new
  tokens, one 64-row micro-batch, checkpointing off, no KL reference;
* ``--model PATH``: a local Hugging Face model directory or a ``.gguf`` file, loaded on
  both sides by :func:`portarl.assets.models.load_local` in fp32 (the code path of ``model.path``
  in a training config: same weights, same tokenizer). Defaults are the README's own-data
  settings: 16 prompts x 8 samples, 64 new tokens, micro-batches of 64 rows, activation
  checkpointing on (portarl's ``auto`` for such a model, and TRL's default), KL weight
  0.001 to a reference copy.

Prompts, with ``--model``: the arithmetic prompts as one-message conversations
(``[{"role": "user", "content": ...}]``). portarl renders them with the tokenizer's chat
template (``data.chat_template=auto``), TRL with the conversational prompt format; both call
``tokenizer.apply_chat_template(..., add_generation_prompt=True, tokenize=True)``, so the
prompt ids are the same on both sides. (Templated text would not be: TRL tokenizes text
prompts with the tokenizer's special tokens added.)

The reward and the prompts: by default the share of digits in the completion (any model
earns some, so a step always has a gradient) on the synthetic arithmetic prompts;
``--reward math_exact`` scores the completion's last number against the answer
(:func:`portarl.assets.rewards.math_exact`, the examples' reward) and ``--data FILE`` takes the
prompts and answers of a JSONL file instead (``examples/data/arith_train.jsonl``: the work
of ``examples/smollm2-arith.yaml``); ``--temperature`` the sampling temperature (default 1), ``--lr`` the learning rate (default 5e-4).
Both sides score with the same function; the reward per sample is reported beside the time.

Micro-batching: portarl takes one optimizer step over ``prompts x group`` samples, its
forwards and backwards in micro-batches of at most ``micro_batch_size`` rows (and at most
``train.max_tokens_per_micro_batch`` tokens, left at its default 16384: 64 rows of the
README's ~113 tokens are 7k). TRL does the same work with
``per_device_train_batch_size = micro_batch_size``, ``gradient_accumulation_steps =
steps_per_generation = samples / micro_batch_size`` (one generation of all the samples,
one optimizer step over them) and ``num_iterations = 1``: :meth:`Work.trl_batching`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

#: The defaults of each kind of work (see the module docstring).
TINY_DEFAULTS = {"prompts_per_step": 8, "group_size": 8, "max_new_tokens": 8, "micro_batch_size": 64,
                 "gradient_checkpointing": False, "beta": 0.0}
MODEL_DEFAULTS = {"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 64, "micro_batch_size": 64,
                  "gradient_checkpointing": True, "beta": 0.001}
TINY_DESCRIPTION = "Qwen2ForCausalLM from a config: vocab 64, hidden {hidden}, {layers} layers, 4 heads / 2 kv, mlp {mlp}, fp32"


@dataclasses.dataclass(frozen=True)
class Work:
    """What both sides do per step. ``model``: None for the tiny model, else a path."""

    model: str | None = None
    prompts_per_step: int = TINY_DEFAULTS["prompts_per_step"]
    group_size: int = TINY_DEFAULTS["group_size"]
    max_new_tokens: int = TINY_DEFAULTS["max_new_tokens"]
    micro_batch_size: int = TINY_DEFAULTS["micro_batch_size"]
    gradient_checkpointing: bool = TINY_DEFAULTS["gradient_checkpointing"]
    beta: float = TINY_DEFAULTS["beta"]
    reward: str = "digits"
    data: str | None = None
    temperature: float = 1.0
    lr: float = 5e-4
    #: the tiny model's shape (``--tiny-layers``, ``--tiny-hidden``; its MLP is 3 x hidden).
    tiny_layers: int = 2
    tiny_hidden: int = 64

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.group_size

    def trl_batching(self) -> dict:
        """TRL's GRPOConfig fields for one optimizer step over the same samples in the same
        micro-batches (the module docstring gives the mapping)."""
        accumulation = self.samples // self.micro_batch_size
        return {"per_device_train_batch_size": self.micro_batch_size, "gradient_accumulation_steps": accumulation,
                "steps_per_generation": accumulation, "num_generations": self.group_size, "num_iterations": 1}

    def check(self) -> None:
        """Raise ValueError naming the flag and the fix for work that cannot run on both sides."""
        for flag, value in (("--prompts-per-step", self.prompts_per_step), ("--group-size", self.group_size),
                            ("--max-new-tokens", self.max_new_tokens), ("--micro-batch-size", self.micro_batch_size)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 (GRPO compares the samples of a prompt), got {self.group_size}")
        if self.beta < 0:
            raise ValueError(f"--beta must be >= 0, got {self.beta}")
        if self.reward not in REWARDS:
            raise ValueError(f"--reward {self.reward}: use one of {', '.join(REWARDS)}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if self.data is not None:
            if self.model is None:
                raise ValueError("--data needs --model: the tiny model's character tokenizer has no chat template")
            if not Path(self.data).is_file():
                raise ValueError(f"--data {self.data}: no such file")
        if (self.tiny_layers, self.tiny_hidden) != (2, 64):
            if self.model is not None:
                raise ValueError("--tiny-layers / --tiny-hidden shape the tiny model: leave them out with --model")
            if self.tiny_layers < 1 or self.tiny_hidden < 4 or self.tiny_hidden % 4:
                raise ValueError(f"--tiny-layers {self.tiny_layers} --tiny-hidden {self.tiny_hidden}: use >= 1 layer and "
                                 "a hidden size that is a positive multiple of 4 (its 4 attention heads)")
        if self.samples % self.micro_batch_size:
            divisors = [d for d in range(1, self.samples + 1) if self.samples % d == 0]
            raise ValueError(f"--micro-batch-size {self.micro_batch_size} does not divide the {self.samples} samples of a "
                             f"step (--prompts-per-step x --group-size): TRL's gradient accumulation needs equal "
                             f"micro-batches; use one of {divisors}")
        if self.model is None and self.max_new_tokens > 64:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens}: the tiny model holds 128 positions; use at most 64 "
                             "or give --model PATH")
        if self.model is not None:
            check_model_path(self.model)

    def argv(self) -> list[str]:
        """This work as worker command-line flags (:func:`add_arguments` reads them back)."""
        out = ["--prompts-per-step", str(self.prompts_per_step), "--group-size", str(self.group_size),
               "--max-new-tokens", str(self.max_new_tokens), "--micro-batch-size", str(self.micro_batch_size),
               "--gradient-checkpointing", "on" if self.gradient_checkpointing else "off", "--beta", repr(self.beta)]
        if self.reward != "digits":
            out += ["--reward", self.reward]
        if self.temperature != 1.0:
            out += ["--temperature", repr(self.temperature)]
        if self.lr != 5e-4:
            out += ["--lr", repr(self.lr)]
        if self.data is not None:
            out += ["--data", self.data]
        if (self.tiny_layers, self.tiny_hidden) != (2, 64):
            out += ["--tiny-layers", str(self.tiny_layers), "--tiny-hidden", str(self.tiny_hidden)]
        return out + (["--model", self.model] if self.model is not None else [])

    def describe(self) -> dict:
        """The work as the JSON result records it."""
        tiny = TINY_DESCRIPTION.format(hidden=self.tiny_hidden, layers=self.tiny_layers, mlp=3 * self.tiny_hidden)
        return {"model": tiny if self.model is None else
                f"{self.model} (portarl.assets.models.load_local, fp32; chat template applied to conversational prompts)",
                "model_path": self.model, "prompts_per_step": self.prompts_per_step, "group_size": self.group_size,
                "max_new_tokens": self.max_new_tokens, "micro_batch_size": self.micro_batch_size,
                "gradient_checkpointing": self.gradient_checkpointing, "beta": self.beta,
                "reward": REWARDS[self.reward][1], "data": self.data or "synthetic arithmetic (portarl.assets.data)",
                "temperature": self.temperature, "lr": self.lr, "trl_batching": self.trl_batching()}


def check_model_path(path: str) -> None:
    """A clear error for a ``--model`` that cannot be loaded, before any worker starts."""
    from portarl.assets.models import resolve_model_path

    try:
        resolved = resolve_model_path(path)
    except FileNotFoundError as err:
        raise ValueError(f"--model {path}: {err}") from None
    if resolved.suffix == ".gguf":
        if not resolved.is_file():
            raise ValueError(f"--model {path}: no such .gguf file")
    elif not (resolved / "config.json").is_file():
        raise ValueError(f"--model {path}: not a Hugging Face model directory (no config.json) nor a .gguf file; "
                         "pass a save_pretrained directory or a .gguf file")


def work_from_args(args) -> Work:
    """The work the command line asks for: each flag left out takes the default of its kind
    of work (tiny, or ``--model``'s README settings)."""
    model = getattr(args, "model", None)
    defaults = MODEL_DEFAULTS if model is not None else TINY_DEFAULTS
    temperature, lr = getattr(args, "temperature", None), getattr(args, "lr", None)
    picked = {"lr": 5e-4 if lr is None else lr, "reward": getattr(args, "reward", None) or "digits", "data": getattr(args, "data", None),
              "temperature": 1.0 if temperature is None else temperature}
    for key, default in (("tiny_layers", 2), ("tiny_hidden", 64)):
        value = getattr(args, key, None)
        picked[key] = default if value is None else value
    for key, default in defaults.items():
        value = getattr(args, key, None)
        if key == "gradient_checkpointing" and isinstance(value, str):
            value = value == "on"
        picked[key] = default if value is None else value
    if model is not None:
        model = str(Path(model).expanduser()) if not str(model).startswith("package:") else str(model)
    return Work(model=model, **picked)


def add_arguments(ap) -> None:
    """The work's flags, on the ``bench step`` parser or a worker's. On the command line
    every default is None, so :func:`work_from_args` can give the kind of work's own."""
    ap.add_argument("--model", metavar="PATH",
                    help="a local Hugging Face model directory or a .gguf file (or package:<pkg>/<file>), loaded on "
                         "both sides as model.path is; default: the tiny built-in model")
    ap.add_argument("--prompts-per-step", type=int, help="prompts per step (default 8; with --model 16)")
    ap.add_argument("--group-size", type=int, help="samples per prompt (default 8)")
    ap.add_argument("--max-new-tokens", type=int, help="new tokens per sample (default 8; with --model 64)")
    ap.add_argument("--micro-batch-size", type=int,
                    help="rows per forward / backward (default 64); TRL: per_device_train_batch_size, with "
                         "gradient_accumulation_steps = steps_per_generation = samples / this")
    ap.add_argument("--gradient-checkpointing", choices=["on", "off"],
                    help="activation checkpointing on both sides (default off; with --model on, TRL's default)")
    ap.add_argument("--beta", type=float, help="KL weight on both sides, 0: no reference model (default 0; with "
                    "--model 0.001, the README's)")
    ap.add_argument("--reward", choices=sorted(REWARDS), help="digits (default): the share of digits in the "
                    "completion; math_exact: its last number against the answer")
    ap.add_argument("--data", metavar="FILE", help="with --model: prompts and answers from this JSONL file (e.g. "
                    "examples/data/arith_train.jsonl) instead of the synthetic arithmetic")
    ap.add_argument("--temperature", type=float, help="sampling temperature on every side (default 1)")
    ap.add_argument("--lr", type=float, help="learning rate on every side (AdamW, constant; default 5e-4)")
    ap.add_argument("--tiny-layers", type=int, help="the tiny model's decoder layers (default 2)")
    ap.add_argument("--tiny-hidden", type=int, help="the tiny model's hidden size (default 64; MLP 3 x it)")


def rss_mib() -> float:
    """The resident set size now, in MiB: the post-load baseline of a worker."""
    from portarl.bench.memory import resident_bytes

    return resident_bytes() / 2**20


def load(work: Work):
    """``(model, tokenizer)`` of the work, fresh: a worker calls it once for the policy (and
    TRL once more for its reference, as it would load its own from the model's path)."""
    if work.model is None:
        return model(layers=work.tiny_layers, hidden_size=work.tiny_hidden), tokenizer()
    import torch

    from portarl.assets.models import load_local

    return load_local(work.model, dtype=torch.float32)


def prompts(work: Work, n: int) -> list[tuple[object, str]]:
    """``n`` (prompt, answer) pairs: plain text for the tiny model (its tokenizer has no chat
    template), one-message conversations for ``--model``; ``--data``: the file's, in order
    (repeated when it has fewer than ``n``)."""
    if work.data is not None:
        from portarl.assets.data import load_examples

        rows = load_examples(work.data)
        return [(rows[i % len(rows)].prompt, rows[i % len(rows)].answer) for i in range(n)]
    pairs = arithmetic_prompts(n)
    if work.model is None:
        return pairs
    return [(({"role": "user", "content": p},), a) for p, a in pairs]


def digit_share(prompt, completion, answer) -> float:
    """The default reward of every side: the share of digits in the completion text."""
    text = completion_text(completion)
    return sum(c.isdigit() for c in text) / max(1, len(text))


#: ``--reward``: (name a portarl config's ``rewards`` takes, description).
REWARDS = {"digits": ("portarl.bench.step_work:digit_share", "share of digits in the completion"),
           "math_exact": ("math_exact", "math_exact: the completion's last number equals the answer")}


def reward_fn(work: Work):
    """The work's reward as a function ``(prompt, completion, answer) -> float`` (both sides)."""
    from portarl.assets.rewards import resolve_reward

    return resolve_reward(REWARDS[work.reward][0])


def checkpointing_on(model) -> bool:
    """Whether any module of ``model`` checkpoints its activations (transformers' per-layer
    flag, set by either trainer): the record shows the work's setting took effect."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def completion_text(completion) -> str:
    """TRL passes conversational completions as message lists; portarl and TRL's text mode as text."""
    if isinstance(completion, (list, tuple)):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return completion


# ---------------------------------------------------------------- the default work's tiny model
VOCAB_CHARS = "0123456789+-*=?., ()abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNO"  # 61 + 3 specials = 64


def tokenizer():
    """A 64-token character-level Hugging Face fast tokenizer: <pad> 0, <bos> 1, <eos> 2."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(VOCAB_CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    assert len(out) == 64
    return out


def model(seed: int = 0, layers: int = 2, hidden_size: int = 64):
    from portarl.assets.models import tiny_qwen2

    return tiny_qwen2(64, seed=seed, layers=layers, hidden_size=hidden_size, intermediate_size=3 * hidden_size)


def arithmetic_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    from portarl.assets.data import arithmetic_examples

    return [(ex.prompt, ex.answer) for ex in arithmetic_examples(n, seed=seed)]
