"""The tool of examples/smollm2-calculator.yaml: a calculator the model calls (Hermes
``<tool_call>`` JSON, described to the model in its system message by portarl since
SmolLM2's chat template declares no tools), and the reward that checks its final answer.

The type hints and the docstring are the tool's JSON schema (transformers' get_json_schema)."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers exactly.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b
