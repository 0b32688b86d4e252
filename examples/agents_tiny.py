"""The environment and the second reward of examples/agents-tiny.yaml (its tool is
``multiply`` of examples/calculator.py).

An episode: the model calls ``multiply`` (a reply with a tool call runs the tool), reads its
result in a ``tool`` turn, and answers; that reply, without a tool call, goes to
:class:`CheckProduct`, which ends the episode with reward 1.0 when its last number is the
product of the row's ``a`` and ``b``, else 0.0 (the built-in reward ``environment`` passes it
to GRPO). :func:`used_the_tool` rewards an episode whose call ran."""

import re


class CheckProduct:
    def reset(self, row):
        self.product = int(row["a"]) * int(row["b"])
        return None  # nothing appended to the prompt

    def step(self, message):
        numbers = re.findall(r"-?\d+", message)
        right = bool(numbers) and int(numbers[-1]) == self.product
        return {"observation": None, "done": True, "reward": 1.0 if right else 0.0}


def used_the_tool(prompts, completions, conversation, **columns):
    """Batched reward: 1.0 for an episode in which a tool ran and answered (a ``tool`` message
    that is not an ``Error: ...``: the call parsed, named a tool and fitted its arguments),
    else 0.0. Multi-turn rollouts add the ``conversation`` column: the messages after the
    prompt, model turns with their parsed ``tool_calls``, tool results, observations."""
    return [1.0 if any(m["role"] == "tool" and not m["content"].startswith("Error:") for m in messages) else 0.0
            for messages in conversation]
