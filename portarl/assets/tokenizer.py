"""Tokenizers the trainer can use: any Hugging Face tokenizer, or one of the built-in
models' tokenizers (made in code, nothing to download): the character-level tokenizer of the
tiny demo model (``model.path: tiny``), and the byte-level ChatML one of ``tiny-chat``
(tools and environments need a chat template).

The trainer only needs :class:`TextCodec`: encode a prompt, decode a completion, and the
pad / eos ids. :func:`as_codec` wraps either kind.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAR_TOKENIZER_FILE = "portarl_char_tokenizer.json"

#: Characters of the built-in arithmetic task (and a little more, for formats).
DEFAULT_CHARS = "0123456789+-*=?., ()abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:\\{}"


#: ``model.path`` values that name a model built in code (see :func:`builtin_tokenizer`).
#: The tiny vision-language models (:mod:`portarl.vision.models`) build their processor themselves.
BUILTIN_MODELS = ("tiny", "tiny-chat", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-moe",
                  "tiny-qwen2-moe")

#: The chat template of the built-in ``tiny-chat`` model: ChatML (SmolLM2's and Qwen2's turn
#: format, no default system message) that declares tools compactly, since every byte is a
#: token: one system line ``Tools: multiply(a, b)`` (a data row's own system message comes
#: first in it), and a tool's result in a ``tool`` turn. The model calls a tool in the
#: hermes format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: the
#: template's opening comment names it (what ``rollout.tool_format: auto`` reads), and the
#: prompt does not spell it out (a tiny model learns it from demonstrations).
CHAT_TEMPLATE = (
    "{#- tool calls: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (hermes) -#}"
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n' }}{% endif %}"
    "{{- 'Tools:' }}{% for t in tools %}{{ ' ' + t.function.name + '(' }}"
    "{{- t.function.get('parameters', {}).get('properties', {}) | list | join(', ') }}{{ ')' + ('' if loop.last else ',') }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}{% if not (tools and loop.first and m.role == 'system') %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class CharTokenizer:
    """One token per character, plus <pad> (0), <bos> (1), <eos> (2). Unknown characters
    raise: silently dropping them would train on different text than the user wrote."""

    pad_token, bos_token, eos_token = "<pad>", "<bos>", "<eos>"

    def __init__(self, chars: str = DEFAULT_CHARS):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer chars must be distinct")
        self.chars = chars
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self._ids = {c: i + 3 for i, c in enumerate(chars)}

    def __len__(self) -> int:
        return len(self.chars) + 3

    @property
    def vocab_size(self) -> int:
        return len(self)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the tokenizer's alphabet") from None
        return ([self.bos_token_id] if add_bos else []) + ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i < 3:
                if not skip_special_tokens:
                    out.append((self.pad_token, self.bos_token, self.eos_token)[i])
                continue
            out.append(self.chars[i - 3])
        return "".join(out)

    def save_pretrained(self, directory: str | Path) -> None:
        """portarl's own file (what :func:`load_tokenizer` reads), plus ``tokenizer.json`` and
        ``tokenizer_config.json`` with the same ids, so ``AutoTokenizer.from_pretrained`` on a
        saved or exported tiny model gives a working tokenizer instead of an empty one."""
        Path(directory, CHAR_TOKENIZER_FILE).write_text(json.dumps({"chars": self.chars}))
        try:
            hf = self.to_hf_tokenizer()
        except ImportError:  # the tokenizers package comes with transformers (the train extra)
            return
        hf.save(str(Path(directory, "tokenizer.json")))
        Path(directory, "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": self.pad_token, "bos_token": self.bos_token,
            "eos_token": self.eos_token, "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
        }, indent=1))

    def to_hf_tokenizer(self):
        """The same tokenizer as a ``tokenizers.Tokenizer``: one token per character (a
        word-level vocabulary over single characters), ``<bos>`` prepended as
        :meth:`encode` does, decoded by plain concatenation."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

        specials = (self.pad_token, self.bos_token, self.eos_token)
        vocab = {tok: i for i, tok in enumerate(specials)} | {c: i for c, i in self._ids.items()}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(list(specials))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{self.bos_token} $A", pair=f"{self.bos_token} $A $B", special_tokens=[(self.bos_token, 1)])
        return tok

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "CharTokenizer":
        return cls(json.loads(Path(directory, CHAR_TOKENIZER_FILE).read_text())["chars"])


def byte_chat_tokenizer():
    """The tokenizer of the built-in ``tiny-chat`` model: one token per UTF-8 byte (so any
    text encodes, nothing is dropped, and text tokenises back to the ids that produced it),
    plus ``<pad>`` (0), ``<|im_start|>`` (1) and ``<|im_end|>`` (2, eos: it ends a turn),
    with :data:`CHAT_TEMPLATE`. A Hugging Face fast tokenizer, so a checkpoint of a
    ``tiny-chat`` run is an ordinary model directory (``AutoTokenizer`` loads it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 bytes as printable characters, in a fixed order
    vocab = {token: i for i, token in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"], model_max_length=1 << 20,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def no_template_fix(tokenizer) -> str:
    """What to do when a chat template is needed and ``tokenizer`` has none: the character
    tokenizer cannot take one (its alphabet has no ``<|im_start|>``), so it is pointed at the
    built-in chat model instead of at ``data.chat_template``."""
    if isinstance(tokenizer, CharTokenizer):
        return ("the character tokenizer of model.path: tiny takes none; use model.path: tiny-chat, the built-in tiny "
                "model with a ChatML chat template (examples/agents-tiny.yaml)")
    return "set data.chat_template to a Jinja template file"


def builtin_tokenizer(path: str):
    """The tokenizer of the built-in model ``model.path`` names, or None for any other path."""
    if path in ("tiny", "tiny-qwen3-moe", "tiny-qwen2-moe"):
        return CharTokenizer()
    if path == "tiny-chat":
        return byte_chat_tokenizer()
    return None


class TextCodec:
    """The tokenizer operations the trainer uses, for either tokenizer kind.

    ``chat_template``: ``"auto"`` renders a prompt with the tokenizer's own chat template
    (and the generation prompt) when the prompt is a conversation or ``system_prompt`` is
    set; ``"none"`` never does (a conversation is then an error); any other value is the
    Jinja source of a template to use for every prompt. Rendering goes through the
    tokenizer's ``apply_chat_template``, so the ids are exactly what the model was
    instruction-tuned on.

    ``stop_token_ids``: eos plus the token that ends an assistant turn when the template
    ends turns with something else (ChatML's ``<|im_end|>``): generation must stop there,
    or the model writes the next user turn itself.
    """

    def __init__(self, tokenizer, *, chat_template: str = "auto", system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if self.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id: generation could never stop")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else self.eos_token_id
        self.system_prompt = system_prompt
        #: Multi-turn rollouts (:func:`portarl.multiturn.agent.configure_codec` sets
        #: them): the tools' JSON schemas for a template that declares ``tools``, or the text
        #: that describes them in the system message for one that does not.
        self.tools: list[dict] | None = None
        self.tool_system: str | None = None
        own = getattr(tokenizer, "chat_template", None)
        if chat_template in ("auto", "none"):
            self.template = own if chat_template == "auto" else None
            self.always_template = False
        else:
            if isinstance(tokenizer, CharTokenizer):
                raise ValueError(f"data.chat_template: no chat support: {no_template_fix(tokenizer)}")
            self.template, self.always_template = chat_template, True
        if system_prompt is not None and self.template is None:
            raise ValueError("data.system_prompt is set but the tokenizer has no chat template "
                             f"({no_template_fix(tokenizer)})")
        self.end_of_turn_id = self._end_of_turn() if self.template is not None else None
        self.stop_token_ids = [self.eos_token_id] + (
            [self.end_of_turn_id] if self.end_of_turn_id not in (None, self.eos_token_id) else [])

    def uses_template(self, prompt) -> bool:
        return self.template is not None and (self.always_template or not isinstance(prompt, str)
                                              or self.system_prompt is not None or bool(self.tools or self.tool_system))

    def messages(self, prompt) -> list[dict]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if self.tool_system:
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{self.tool_system}"}
            else:
                messages.insert(0, {"role": "system", "content": self.tool_system})
        return messages

    def _apply(self, messages, **kwargs):
        if self.tools:
            kwargs.setdefault("tools", self.tools)
        out = self.tokenizer.apply_chat_template(
            messages, chat_template=None if self.template is getattr(self.tokenizer, "chat_template", None) else self.template,
            **kwargs)
        if not isinstance(out, (str, list)):  # transformers >= 5 returns a BatchEncoding by default
            out = out["input_ids"]
        return out

    def render_text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """``messages`` rendered by the chat template as text (tools included when set)."""
        return self._apply(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def _end_of_turn(self) -> int | None:
        """The first token after an assistant message's content in the rendered template,
        when it is a special token (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``)."""
        marker = "PORTARL_END_MARKER"
        try:
            text = self._apply([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                               tokenize=False)
        except Exception:  # templates that refuse a probe conversation: eos alone stops
            return None
        tail = text[text.rfind(marker) + len(marker):].lstrip(" ")
        ids = self.tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        if ids and (ids[0] in special or ids[0] in added):
            return int(ids[0])
        return None

    def encode_prompt(self, prompt) -> list[int]:
        if self.uses_template(prompt):
            return [int(i) for i in self._apply(self.messages(prompt), add_generation_prompt=True, tokenize=True)]
        if not isinstance(prompt, str):
            raise ValueError("the prompt is a conversation but there is no chat template (data.chat_template is "
                             f"'none' or the tokenizer has none): {no_template_fix(self.tokenizer)}")
        if isinstance(self.tokenizer, CharTokenizer):
            return self.tokenizer.encode(prompt)
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_continuation(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, CharTokenizer):
            return self.tokenizer.encode(text, add_bos=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def completion_end_id(self) -> int:
        """The token that ends a completion (supervised targets): end of turn, else eos."""
        return self.end_of_turn_id if self.end_of_turn_id is not None else self.eos_token_id

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def as_codec(tokenizer, **options) -> TextCodec:
    """``options``: ``chat_template``, ``system_prompt`` (see :class:`TextCodec`). A
    vision-language model's processor: :func:`portarl.vision.codec.codec_for`."""
    return tokenizer if isinstance(tokenizer, TextCodec) else TextCodec(tokenizer, **options)


def load_tokenizer(directory: str | Path):
    """The tokenizer saved in a local model directory (char tokenizer or HF)."""
    directory = Path(directory)
    if (directory / CHAR_TOKENIZER_FILE).exists():
        return CharTokenizer.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def chat_template_option(value: str | None) -> str:
    """``data.chat_template`` as :class:`TextCodec` takes it: ``auto`` / ``none`` as they are,
    anything else a Jinja template file, read here (its path is named if it is missing)."""
    if value in (None, "auto", "none"):
        return value or "auto"
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"data.chat_template: {value!r} is neither 'auto', 'none' nor a Jinja template file")
    return path.read_text()
