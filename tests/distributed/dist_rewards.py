"""A reward with spread even for an untrained model (so advantages and gradients are not 0)."""


def length_and_digits(prompt: str, completion: str, answer: str) -> float:
    return (len(completion) % 3) / 2 + 0.25 * sum(c.isdigit() for c in completion)
