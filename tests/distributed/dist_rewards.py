"""A reward with spread even for an untrained model (so advantages and gradients are not 0)."""


def length_and_digits(prompt: str, completion: str, answer: str) -> float:
    return (len(completion) % 3) / 2 + 0.25 * sum(c.isdigit() for c in completion)


def fails_on_rank_1_at_step_2(prompt: str, completion: str, answer: str) -> float:
    """Scores like length_and_digits, but raises on rank 1 only, from its second call on
    (the second step: one call per sample, 8 samples per rank per step in the test)."""
    import os

    fails_on_rank_1_at_step_2.calls = getattr(fails_on_rank_1_at_step_2, "calls", 0) + 1
    if os.environ.get("RANK") == "1" and fails_on_rank_1_at_step_2.calls > 8:
        raise ValueError("the grader is down on this host")
    return length_and_digits(prompt, completion, answer)


def fails_in_the_second_batch(prompt: str, completion: str, answer: str) -> float:
    """Scores like length_and_digits, but raises from its 17th call on: in the async rollout
    worker, which scores whole batches (4 prompts x 4 samples in the test), that is the
    second step's batch."""
    fails_in_the_second_batch.calls = getattr(fails_in_the_second_batch, "calls", 0) + 1
    if fails_in_the_second_batch.calls > 16:
        raise ValueError("the grader is down")
    return length_and_digits(prompt, completion, answer)
