"""Prompt data: JSONL or Parquet files with a prompt and an answer field, or the built-in
synthetic arithmetic task.

Errors name the file, the line (JSONL) or row, and the missing field.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def load_examples(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer") -> list[Example]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.suffix == ".jsonl":
        rows = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
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
    examples = []
    for where, row in rows:
        for field in (prompt_field, answer_field):
            if not isinstance(row, dict) or field not in row:
                raise ValueError(f"{where}: missing field {field!r} (set data.prompt_field / data.answer_field)")
        examples.append(Example(str(row[prompt_field]), str(row[answer_field])))
    if not examples:
        raise ValueError(f"data file {path} has no examples")
    return examples


def write_jsonl(examples: list[Example], path: str | Path) -> None:
    with Path(path).open("w") as f:
        for ex in examples:
            f.write(json.dumps({"prompt": ex.prompt, "answer": ex.answer}) + "\n")


def arithmetic_examples(n: int, *, seed: int = 0, max_operand: int = 9, ops: str = "+") -> list[Example]:
    """``n`` problems "a+b=" with answers, operands in [0, max_operand], seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append(Example(f"{a}{op}{b}=", str(value)))
    return out
