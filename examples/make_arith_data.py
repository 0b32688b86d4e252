"""Writes the example's data: single-digit addition asked in natural language, as
conversational JSONL (TRL's format) with the answer in its own column.

    python examples/make_arith_data.py   # -> examples/data/arith_train.jsonl, arith_eval.jsonl

All 100 pairs (a, b) in 0..9, each with one phrasing; 80 for training, 20 held out.
"""

import json
import random
from pathlib import Path

PHRASINGS = [
    "What is {a} + {b}?",
    "What is {a} plus {b}?",
    "Add {a} and {b}. What do you get?",
    "If I have {a} apples and get {b} more, how many apples do I have?",
    "Compute the sum of {a} and {b}.",
]


def main() -> None:
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(pairs)
    rows = [{"prompt": [{"role": "user", "content": rng.choice(PHRASINGS).format(a=a, b=b)}], "answer": str(a + b)}
            for a, b in pairs]
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    for name, part in (("arith_train.jsonl", rows[:80]), ("arith_eval.jsonl", rows[80:])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()
