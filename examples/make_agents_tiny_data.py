"""Writes the data of examples/agents-tiny.yaml: "What is 7 times 8?" for every pair of
single-digit factors from 2 to 9, as conversational JSONL.

    python examples/make_agents_tiny_data.py   # -> examples/data/agents_tiny{,_sft}.jsonl

``agents_tiny.jsonl`` (64 rows, the GRPO prompts): ``prompt`` and the factors ``a`` and
``b``, which the environment checks the answer against.

``agents_tiny_sft.jsonl`` (128 rows, ``data.sft_path``: the supervised warm-up's
demonstrations, since a randomly initialised model never writes a tool call by chance):
each solved episode as its two model turns, one row each. The question, answered with the
call ``<tool_call>{"name": "multiply", "arguments": {"a": 7, "b": 8}}</tool_call>``; and
the question, that call and the tool's result (a ``tool`` message, as the episode appends
it), answered with the product.
"""

import json
from pathlib import Path


def main() -> None:
    rows, demonstrations = [], []
    for a in range(2, 10):
        for b in range(2, 10):
            question = [{"role": "user", "content": f"What is {a} times {b}?"}]
            call = "<tool_call>" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}) + "</tool_call>"
            rows.append({"prompt": question, "a": a, "b": b})
            demonstrations.append({"prompt": question, "answer": call})
            demonstrations.append({"prompt": question + [{"role": "assistant", "content": call},
                                                         {"role": "tool", "name": "multiply", "content": str(a * b)}],
                                   "answer": str(a * b)})
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    (out / "agents_tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "agents_tiny_sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in demonstrations))


if __name__ == "__main__":
    main()
