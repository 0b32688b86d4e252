"""Tokenizers the trainer can use: any Hugging Face tokenizer, or the built-in
character-level tokenizer (made in code, for the tiny demo model; nothing to download).

The trainer only needs :class:`TextCodec`: encode a prompt, decode a completion, and the
pad / eos ids. :func:`as_codec` wraps either kind.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAR_TOKENIZER_FILE = "portarl_char_tokenizer.json"

#: Characters of the built-in arithmetic task (and a little more, for formats).
DEFAULT_CHARS = "0123456789+-*=?., ()abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:\\{}"


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
        Path(directory, CHAR_TOKENIZER_FILE).write_text(json.dumps({"chars": self.chars}))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "CharTokenizer":
        return cls(json.loads(Path(directory, CHAR_TOKENIZER_FILE).read_text())["chars"])


class TextCodec:
    """The tokenizer operations the trainer uses, for either tokenizer kind."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if self.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id: generation could never stop")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else self.eos_token_id

    def encode_prompt(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, CharTokenizer):
            return self.tokenizer.encode(text)
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_continuation(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, CharTokenizer):
            return self.tokenizer.encode(text, add_bos=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def as_codec(tokenizer) -> TextCodec:
    return tokenizer if isinstance(tokenizer, TextCodec) else TextCodec(tokenizer)


def load_tokenizer(directory: str | Path):
    """The tokenizer saved in a local model directory (char tokenizer or HF)."""
    directory = Path(directory)
    if (directory / CHAR_TOKENIZER_FILE).exists():
        return CharTokenizer.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)
