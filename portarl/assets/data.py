"""Prompt data: JSONL or Parquet rows, or the built-in synthetic arithmetic task.

A row's prompt is a plain string or a conversation (TRL's conversational format: a list
of ``{"role": ..., "content": ...}`` messages, rendered with the tokenizer's chat
template). The answer field is optional: it is needed only by per-sample rewards
``fn(prompt, completion, answer)`` and by the supervised warm-up. Every other column is
kept as is and handed to batched rewards ``fn(prompts, completions, **columns)``.

Values are never coerced behind the user's back: a JSONL ``null`` or ``[4]`` prompt would
otherwise train on the text "None" / "[4]". Errors name the file and line (JSONL) or row
(Parquet) and the field: bytes that are not UTF-8 too (JSONL is read as UTF-8 whatever the
locale). An empty or whitespace-only prompt (a conversation whose every non-system message
is) is refused the same way, or, with ``data.empty_prompts: skip``, left out and counted:
it would otherwise be trained on as if it said something.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from pathlib import Path
from typing import Any

log = logging.getLogger("portarl.assets.data")

#: ``data.empty_prompts``: what to do with a row whose prompt is empty or only whitespace.
EMPTY_PROMPTS = ("error", "skip")


@dataclasses.dataclass(frozen=True)
class Example:
    #: A string, or a tuple of ``{"role", "content"}`` dicts (a conversation).
    prompt: Any
    #: The reference answer as text; None when the row has no answer field.
    answer: str | None = None
    #: The row's other columns (answer included, unconverted), for batched rewards.
    columns: dict = dataclasses.field(default_factory=dict, compare=False)
    #: Where the row came from (``file:line``), for error messages.
    where: str = dataclasses.field(default="", compare=False)

    @property
    def is_conversational(self) -> bool:
        return not isinstance(self.prompt, str)

    @property
    def prompt_text(self) -> str:
        """A readable form of the prompt (logs, per-sample rewards): the string itself, or the
        conversation's messages as ``role: content`` lines."""
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.prompt)


def _describe(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {json.dumps(value, default=str)[:60]}"


def parse_prompt(value, where: str, field: str):
    """A string, or a list of ``{role, content}`` string messages (returned as a tuple)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"{where}: field {field!r} message {i} must be {{\"role\": str, \"content\": str}}, "
                                 f"got {_describe(m)}")
            messages.append({"role": m["role"], "content": m["content"]})
        return tuple(messages)
    raise ValueError(f"{where}: field {field!r} must be a string or a list of {{role, content}} messages, got "
                     f"{_describe(value)}")


def parse_answer(value, where: str, field: str) -> str:
    """Strings as they are; numbers (``"answer": 4``) as their text; anything else refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{where}: field {field!r} must be a string or a number, got {_describe(value)}")


def is_empty_prompt(prompt) -> bool:
    """A string that is empty or whitespace, or a conversation whose every non-system
    message is (a system prompt alone asks nothing)."""
    if isinstance(prompt, str):
        return not prompt.strip()
    return all(not m["content"].strip() for m in prompt if m["role"] != "system")


def _decoded(raw: bytes, where: str, first: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")  # a byte-order mark is allowed at the start
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line); "
                         "save the file as UTF-8") from None


def load_examples_for(data, path: str | Path | None = None) -> list[Example]:
    """:func:`load_examples` with a ``data`` config section's fields (``path``: another
    file read the same way, e.g. ``eval.data``)."""
    return load_examples(data.path if path is None else path, prompt_field=data.prompt_field,
                         answer_field=data.answer_field, empty_prompts=data.empty_prompts)


def load_examples(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer",
                  empty_prompts: str = "error") -> list[Example]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.suffix == ".jsonl":
        rows = []
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = _decoded(raw, f"{path}:{lineno}", lineno == 1)
                if not line.strip():
                    continue
                try:
                    rows.append((f"{path}:{lineno}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading Parquet needs pyarrow: `pip install pyarrow`") from None
        table = pq.read_table(path)
        rows = [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())]
    else:
        raise ValueError(f"data file {path}: use .jsonl or .parquet")
    examples, skipped = [], []
    for where, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: each row must be a JSON object, got {_describe(row)}")
        if prompt_field not in row:
            raise ValueError(f"{where}: missing field {prompt_field!r} (set data.prompt_field)")
        prompt = parse_prompt(row[prompt_field], where, prompt_field)
        if is_empty_prompt(prompt):
            if empty_prompts != "skip":
                raise ValueError(f"{where}: field {prompt_field!r} is empty or only whitespace: fix or remove the row, "
                                 "or set data.empty_prompts=skip to leave such rows out")
            skipped.append(where)
            continue
        answer = parse_answer(row[answer_field], where, answer_field) if answer_field in row else None
        columns = {k: v for k, v in row.items() if k != prompt_field}
        examples.append(Example(prompt, answer, columns, where))
    if skipped:
        log.warning("data.empty_prompts=skip: left out %d row(s) of %s whose prompt is empty or only whitespace (%s%s)",
                    len(skipped), path, ", ".join(skipped[:3]), ", ..." if len(skipped) > 3 else "")
    if not examples:
        raise ValueError(f"data file {path} has no examples" + (f" ({len(skipped)} with an empty prompt were left out)"
                                                                 if skipped else ""))
    return examples


def encode_examples(examples: list[Example], codec, *, context_length: int | None = None,
                    max_new_tokens: int = 0) -> list[list[int]]:
    """Every prompt's token ids, computed once when the data loads: a prompt the tokenizer
    cannot encode, or one too long for the model, is reported with its ``file:line`` now
    rather than at the step that happens to draw it."""
    out = []
    for i, ex in enumerate(examples):
        where = ex.where or f"example {i}"
        encode_example = getattr(codec, "encode_example", None)  # a vision-language model's codec
        if encode_example is None and getattr(ex, "images", ()):
            raise ValueError(f"{where}: the row has images but the model reads text only (model.path is not a "
                             "vision-language model)")
        try:
            ids = encode_example(ex) if encode_example is not None else codec.encode_prompt(ex.prompt)
        except ValueError as err:
            raise ValueError(f"{where}: the prompt cannot be encoded: {err}") from None
        if not ids:
            raise ValueError(f"{where}: the prompt encodes to no tokens")
        if context_length is not None and len(ids) + max_new_tokens > context_length:
            raise ValueError(f"{where}: the prompt is {len(ids)} tokens; with rollout.max_new_tokens={max_new_tokens} "
                             f"that exceeds the model's context length {context_length} (shorten the prompt or lower "
                             "rollout.max_new_tokens)")
        out.append(ids)
    return out


def write_jsonl(examples: list[Example], path: str | Path) -> None:
    with Path(path).open("w") as f:
        for ex in examples:
            prompt = ex.prompt if isinstance(ex.prompt, str) else list(ex.prompt)
            row = {**ex.columns, "prompt": prompt}
            if ex.answer is not None:
                row["answer"] = ex.answer
            f.write(json.dumps(row) + "\n")


def arithmetic_examples(n: int, *, seed: int = 0, max_operand: int = 9, ops: str = "+") -> list[Example]:
    """``n`` problems "a+b=" with answers, operands in [0, max_operand], seeded."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append(Example(f"{a}{op}{b}=", str(value), {"answer": str(value)}, f"synthetic example {i}"))
    return out
