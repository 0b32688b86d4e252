"""The reward of examples/vlm-colours.yaml: 1.0 when the completion names the square's
colour and nothing else (case and surrounding spaces aside), else 0.0."""


def colour_match(prompt: str, completion: str, answer: str) -> float:
    return 1.0 if completion.strip().lower().rstrip(".") == answer else 0.0
