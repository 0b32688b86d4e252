"""Sample completions a person can read: ``samples.jsonl``, one on the console, and
TensorBoard text, every ``logging.samples_every`` steps and at the first step.

Metrics say *that* the reward is flat; only the text says *why* (an empty completion, the
model writing the next user turn, an answer the reward cannot parse). Each row: step,
sample index, prompt, completion, each reward function's value (null where the function
gave none), the total reward, the advantage (null on a skipped step) and the finish reason
(``stop``: an end token; ``length``: max_new_tokens reached). A value that is not finite
is null too (JSON has no NaN), and the row's ``nonfinite`` names it with its value
(``{"advantage": "nan"}``), so a null never hides a NaN.

Multi-turn episodes (tools, environments) add the whole ``conversation`` after the prompt,
message by message (the model's turns, tool calls, tool results and observations, each
with the tokens it took), its ``turns``, and the episode's finish reason
(:mod:`portarl.multiturn.episode`); ``completion`` is the final model turn.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger("portarl.samples")


def pick(n: int, count: int) -> list[int]:
    """``count`` sample indices spread over the batch (one per group when groups are many)."""
    if count <= 0 or n <= 0:
        return []
    stride = max(1, n // count)
    return list(range(0, n, stride))[:count]


class SampleLog:
    def __init__(self, output_dir: str | Path, every: int, count: int, writer=None, echo: bool = True):
        self.path = Path(output_dir) / "samples.jsonl"
        self.every, self.count, self.writer, self.echo = every, count, writer, echo

    def due(self, step: int) -> bool:
        return self.every > 0 and self.count > 0 and (step == 1 or step % self.every == 0)

    def write(self, step: int, samples: dict) -> list[dict]:
        """``samples``: ``prompts`` (text), ``completions``, ``finished``, ``rewards`` (name ->
        values), ``total``, ``advantages`` (or None), one entry per sample of this rank."""
        rows = []
        for i in pick(len(samples["completions"]), self.count):
            adv = samples.get("advantages")
            nonfinite: dict[str, str] = {}
            row = {
                "step": step, "sample": i, "prompt": samples["prompts"][i], "completion": samples["completions"][i],
                "rewards": {name: _num(values[i], f"rewards.{name}", nonfinite)
                            for name, values in samples["rewards"].items()},
                "reward": _num(samples["total"][i], "reward", nonfinite) if samples.get("total") is not None else None,
                "advantage": _num(adv[i], "advantage", nonfinite) if adv is not None else None,
                "finish_reason": "stop" if samples["finished"][i] else "length",
            }
            if nonfinite:
                row["nonfinite"] = nonfinite
            episode = (samples.get("episodes") or [None] * (i + 1))[i]
            if episode is not None:
                row.update(conversation=episode["messages"], turns=episode["turns"], finish_reason=episode["finish"])
            rows.append(row)
        with self.path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        if rows and self.echo:
            r = rows[0]
            log.info("sample at step %d: prompt %r -> completion %r (rewards %s, finish %s)", step,
                     _short(r["prompt"]), _short(r["completion"]), r["rewards"], r["finish_reason"])
        if self.writer is not None and rows:
            text = "\n\n".join(
                f"**prompt**: `{_md(r['prompt'])}`  \n**completion**: `{_md(r['completion'])}`  \n"
                f"rewards {r['rewards']}, advantage {r['advantage']}, finish {r['finish_reason']}" for r in rows)
            self.writer.add_text("samples", text, step)
        return rows


def _num(value, field: str, nonfinite: dict):
    """A JSON number, or None; a non-finite value is recorded in ``nonfinite[field]``."""
    if value is None:
        return None
    value = float(value)
    if math.isfinite(value):
        return value
    nonfinite[field] = str(value)
    return None


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _md(text: str) -> str:
    return text.replace("`", "'").replace("\n", " ⏎ ")
