"""The vLLM judge test's parse rule (imported by the trainer as ``judge_parse:reply_length``):
a tiny random model writes no number, so the score is the reply's length."""


def reply_length(reply: str) -> float:
    return float(len(reply))
