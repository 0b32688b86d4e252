"""A user reward (``module:function``) that is always NaN: drives the stop-with-exit-3 test."""


def always_nan(prompt: str, completion: str, answer: str) -> float:
    return float("nan")
