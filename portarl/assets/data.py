"""Prompt data: JSONL or Parquet rows, or the built-in synthetic arithmetic task.

A row's prompt is a plain string or a conversation (TRL's conversational format: a list
of ``{"role": ..., "content": ...}`` messages, rendered with the tokenizer's chat
template). A message's content is a string, or (vision-language prompts, TRL's format) a
list of parts ``{"type": "text", "text": ...}`` and ``{"type": "image"}``: each image
placeholder takes the next image of the row's images column (``data.image_field``, default
``images``: paths relative to the data file, or encoded bytes), checked and decoded once
when the data loads (:mod:`portarl.vision.images`). The answer field is optional: it is
needed only by per-sample rewards ``fn(prompt, completion, answer)`` and by the supervised
warm-up. Every other column is kept as is and handed to batched rewards
``fn(prompts, completions, **columns)`` (the images column is not: it is on
:attr:`Example.images`).

Values are never coerced behind the user's back: a JSONL ``null`` or ``[4]`` prompt would
otherwise train on the text "None" / "[4]". Errors name the file and line (JSONL) or row
(Parquet) and the field: bytes that are not UTF-8 too (JSONL is read as UTF-8 whatever the
locale). An empty or whitespace-only prompt (a conversation whose every non-system message
is) is refused the same way, or, with ``data.empty_prompts: skip``, left out and counted:
it would otherwise be trained on as if it said something.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

from portarl.vision.images import ImageSource, check_images, count_placeholders

log = logging.getLogger("portarl.assets.data")

#: ``data.empty_prompts``: what to do with a row whose prompt is empty or only whitespace.
EMPTY_PROMPTS = ("error", "skip")


@dataclasses.dataclass(frozen=True)
class Example:
    #: A string, or a tuple of ``{"role", "content"}`` dicts (a conversation); a content is a
    #: string or a tuple of ``{"type": "text", "text"}`` / ``{"type": "image"}`` parts.
    prompt: Any
    #: The reference answer as text; None when the row has no answer field.
    answer: str | None = None
    #: The row's other columns (answer included, unconverted), for batched rewards.
    columns: dict = dataclasses.field(default_factory=dict, compare=False)
    #: Where the row came from (``file:line``), for error messages.
    where: str = dataclasses.field(default="", compare=False)
    #: The row's images (:class:`~portarl.vision.images.ImageSource`), in the order of the
    #: prompt's ``{"type": "image"}`` placeholders; () for a text-only row.
    images: tuple = ()

    @property
    def is_conversational(self) -> bool:
        return not isinstance(self.prompt, str)

    @property
    def prompt_text(self) -> str:
        """A readable form of the prompt (logs, per-sample rewards): the string itself, or the
        conversation's messages as ``role: content`` lines (a content's parts joined, each
        image as ``<image>``)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(f"{m['role']}: {content_text(m['content'])}" for m in self.prompt)


def content_text(content) -> str:
    """A message content as text: a string as it is; parts joined, an image as ``<image>``."""
    if isinstance(content, str):
        return content
    return "".join("<image>" if part["type"] == "image" else part["text"] for part in content)


def _describe(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {json.dumps(value, default=str)[:60]}"


#: Keys of an image part that would hold the image itself: refused, the images column holds it.
_INLINE_IMAGE_KEYS = ("image", "url", "path", "base64", "bytes", "image_url")


def _parse_part(part, where: str) -> dict:
    """One content part: ``{"type": "text", "text": str}`` or ``{"type": "image"}``. Keys
    that are null are ignored (Parquet gives every struct the union of the parts' keys)."""
    if not isinstance(part, dict):
        raise ValueError(f"{where} must be {{\"type\": \"text\", \"text\": str}} or {{\"type\": \"image\"}}, "
                         f"got {_describe(part)}")
    set_keys = sorted(k for k, v in part.items() if v is not None and k != "type")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: a text part needs \"text\": str, got {_describe(part.get('text'))}")
        if extra := [k for k in set_keys if k != "text"]:
            raise ValueError(f"{where}: a text part has only \"type\" and \"text\", got key {extra[0]!r}")
        return {"type": "text", "text": part["text"]}
    if kind == "image":
        if inline := [k for k in set_keys if k in _INLINE_IMAGE_KEYS]:
            raise ValueError(f"{where}: an image part is a placeholder {{\"type\": \"image\"}}; the image itself "
                             f"goes in the row's images column (data.image_field), not in key {inline[0]!r}")
        if set_keys:
            raise ValueError(f"{where}: an image part is {{\"type\": \"image\"}} alone, got key {set_keys[0]!r}")
        return {"type": "image"}
    raise ValueError(f"{where}: part type must be \"text\" or \"image\", got {_describe(kind)}")


def _parse_content(content, where: str):
    """A message content: a string, or a non-empty list of parts (returned as a tuple)."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)) and content:
        return tuple(_parse_part(part, f"{where} part {j}") for j, part in enumerate(content))
    raise ValueError(f"{where} content must be a string or a non-empty list of "
                     f"{{\"type\": \"text\" | \"image\"}} parts, got {_describe(content)}")


def parse_prompt(value, where: str, field: str):
    """A string, or a list of ``{role, content}`` messages (returned as a tuple); a content
    is a string or a non-empty list of text / image parts (a tuple)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
                raise ValueError(f"{where}: field {field!r} message {i} must be {{\"role\": str, \"content\": str "
                                 f"or a list of parts}}, got {_describe(m)}")
            content = _parse_content(m["content"], f"{where}: field {field!r} message {i}")
            messages.append({"role": m["role"], "content": content})
        return tuple(messages)
    raise ValueError(f"{where}: field {field!r} must be a string or a list of {{role, content}} messages, got "
                     f"{_describe(value)}")


def _image_source(value, where: str, field: str, base: Path) -> ImageSource:
    """One image of the images column: a path (relative to ``base``), bytes, or the
    ``{"bytes": ..., "path": ...}`` mapping Hugging Face ``datasets`` writes (bytes as
    base64 text in JSONL); the bytes win when both are set."""
    def from_path(p: str) -> ImageSource:
        if not p:
            raise ValueError(f"{where}: field {field!r} has an empty image path")
        return ImageSource(os.path.abspath(base / p), None, where)

    if isinstance(value, str):
        return from_path(value)
    if isinstance(value, (bytes, bytearray)):
        return ImageSource(None, bytes(value), where)
    if isinstance(value, dict) and (value.get("bytes") is not None or value.get("path") is not None):
        data = value.get("bytes")
        if isinstance(data, (bytes, bytearray)):
            return ImageSource(None, bytes(data), where)
        if isinstance(data, str):
            try:
                return ImageSource(None, base64.b64decode(data, validate=True), where)
            except (binascii.Error, ValueError):
                raise ValueError(f"{where}: field {field!r} \"bytes\" is not valid base64") from None
        if data is None and isinstance(value.get("path"), str):
            return from_path(value["path"])
    raise ValueError(f"{where}: field {field!r} image must be a path string, bytes, or {{\"bytes\": base64}} / "
                     f"{{\"path\": str}}, got {_describe(value)}")


def parse_images(value, where: str, field: str, base: Path) -> tuple:
    """The images column of one row: a list of images, or a single one; null or [] is none."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return tuple(_image_source(v, f"{where} image {i}", field, base) for i, v in enumerate(items))


def parse_answer(value, where: str, field: str) -> str:
    """Strings as they are; numbers (``"answer": 4``) as their text; anything else refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{where}: field {field!r} must be a string or a number, got {_describe(value)}")


def is_empty_prompt(prompt) -> bool:
    """A string that is empty or whitespace, or a conversation whose every non-system
    message is (a system prompt alone asks nothing; a message with an image is not empty)."""
    if isinstance(prompt, str):
        return not prompt.strip()
    return all(_is_empty_content(m["content"]) for m in prompt if m["role"] != "system")


def _is_empty_content(content) -> bool:
    """A string or text parts that are empty or whitespace; an image part is not empty."""
    if isinstance(content, str):
        return not content.strip()
    return all(part["type"] == "text" and not part["text"].strip() for part in content)


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
                         answer_field=data.answer_field, empty_prompts=data.empty_prompts,
                         image_field=data.image_field)


def load_examples(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer",
                  empty_prompts: str = "error", image_field: str = "images") -> list[Example]:
    """The rows of a JSONL / Parquet file as :class:`Example` values, each checked now (see
    the module docstring); rows with images have them opened and decoded once here
    (:func:`portarl.vision.images.check_images`), so a bad image fails the load, not a step."""
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
        images = parse_images(row.get(image_field), where, image_field, path.parent)
        columns = {k: v for k, v in row.items() if k not in (prompt_field, image_field)}
        examples.append(Example(prompt, answer, columns, where, images))
    if skipped:
        log.warning("data.empty_prompts=skip: left out %d row(s) of %s whose prompt is empty or only whitespace (%s%s)",
                    len(skipped), path, ", ".join(skipped[:3]), ", ..." if len(skipped) > 3 else "")
    if not examples:
        raise ValueError(f"data file {path} has no examples" + (f" ({len(skipped)} with an empty prompt were left out)"
                                                                 if skipped else ""))
    if any(ex.images or count_placeholders(ex.prompt) for ex in examples):
        check_images(examples, image_field=image_field)
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
    """The examples as JSONL that :func:`load_examples` reads back to equal examples: the
    fields ``prompt``, ``answer`` and ``images`` (whatever the fields were called when read),
    every other column as it is. An image is written as its absolute path, or its bytes as
    ``{"bytes": base64}``."""
    with Path(path).open("w") as f:
        for ex in examples:
            prompt = ex.prompt if isinstance(ex.prompt, str) else list(ex.prompt)  # part tuples become lists
            row = {**ex.columns, "prompt": prompt}
            if ex.answer is not None:
                row["answer"] = ex.answer
            if ex.images:
                row["images"] = images_json(ex.images)
            f.write(json.dumps(row) + "\n")


def example_json(ex: Example) -> dict:
    """``ex`` as JSON (what the trainer sends an asynchronous rollout worker); :func:`example_from_json` reads it back."""
    prompt = ex.prompt if isinstance(ex.prompt, str) else list(ex.prompt)
    return {"prompt": prompt, "answer": ex.answer, "columns": ex.columns, "where": ex.where,
            "images": images_json(ex.images)}


def example_from_json(row: dict) -> Example:
    """The :class:`Example` of :func:`example_json`'s output: a conversation as a tuple of
    messages, a content of parts as a tuple (as :func:`load_examples` keeps them)."""
    prompt = row["prompt"]
    if not isinstance(prompt, str):
        prompt = tuple({**m, "content": m["content"] if isinstance(m["content"], str) else tuple(m["content"])}
                       for m in prompt)
    return Example(prompt, row["answer"], row["columns"], row["where"],
                   parse_images(row.get("images"), row["where"], "images", Path("/")))


def images_json(images) -> list:
    """``images`` (:class:`~portarl.vision.images.ImageSource`) as JSON values that
    :func:`parse_images` reads back: each an absolute path, or its bytes as ``{"bytes": base64}``."""
    return [os.path.abspath(im.path) if im.data is None else {"bytes": base64.b64encode(im.data).decode("ascii")}
            for im in images]


def arithmetic_examples(n: int, *, seed: int = 0, max_operand: int = 9, ops: str = "+") -> list[Example]:
    """``n`` problems "a+b=" with answers, operands in [0, max_operand], seeded."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append(Example(f"{a}{op}{b}=", str(value), {"answer": str(value)}, f"synthetic example {i}"))
    return out
