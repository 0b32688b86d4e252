"""Writes the data of examples/smollm2-calculator.yaml: multiplications of a three-digit by a
two-digit number, which SmolLM2-135M cannot do in its head but can with the multiply tool.

    python examples/make_calculator_data.py   # -> examples/data/multiply_{train,eval,sft}.jsonl

Conversational JSONL (TRL's format) with the product in the answer column; 200 for
training, 40 held out, seeded; and 100 tool-call demonstrations (multiply_sft.jsonl) for\n`portarl sft`.
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
    (out / "multiply_sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_rows(rng, 100)))


def sft_rows(rng: random.Random, n: int) -> list[dict]:
    """Tool-call demonstrations for a short supervised warm-up (SmolLM2-135M never calls the
    tool unprompted, so GRPO alone gets no reward to learn from): the prompt as GRPO renders
    it (portarl's tool description as the system message) and the first model turn, the call.
    Other questions than the GRPO and eval sets."""
    from portarl.multiturn.render import tool_system_text
    from portarl.multiturn.tools import load_tools

    schema = load_tools(["calculator:multiply"], [str(Path(__file__).parent)])["multiply"].schema
    system = {"role": "system", "content": tool_system_text([schema])}
    rows = []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
        rows.append({"prompt": [system, {"role": "user", "content": rng.choice(PHRASINGS).format(a=a, b=b)}],
                     "answer": f"<tool_call>\n{call}\n</tool_call>"})
    return rows


if __name__ == "__main__":
    main()
