"""Writes the data of examples/smollm2-calculator.yaml: multiplications of a three-digit by a
two-digit number, which SmolLM2-135M cannot do in its head but can with the multiply tool.

    python examples/make_calculator_data.py   # -> examples/data/multiply_train.jsonl, multiply_eval.jsonl

Conversational JSONL (TRL's format) with the product in the answer column; 200 for
training, 40 held out, seeded.
"""

import json
import random
from pathlib import Path

PHRASINGS = [
    "What is {a} times {b}?",
    "Compute {a} * {b}.",
    "What is the product of {a} and {b}?",
    "Multiply {a} by {b}.",
]


def main() -> None:
    rng = random.Random(0)
    rows = []
    for _ in range(240):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": rng.choice(PHRASINGS).format(a=a, b=b)}],
                     "answer": str(a * b)})
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    for name, part in (("multiply_train.jsonl", rows[:200]), ("multiply_eval.jsonl", rows[200:])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()
