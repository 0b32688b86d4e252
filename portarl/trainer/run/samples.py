"""Sample completions a person can read: ``samples.jsonl``, one on the console, TensorBoard
text and a table for each other experiment tracker, every ``logging.samples_every`` steps
and at the first step.

Metrics say *that* the reward is flat; only the text says *why* (an empty completion, the
model writing the next user turn, an answer the reward cannot parse). Each row: step,
sample index, prompt, completion, each reward function's value (null where the function
gave none), the total reward, the advantage (null on a skipped step) and the finish reason
(``stop``: an end token; ``length``: max_new_tokens reached). A value that is not finite
is null too (JSON has no NaN), and the row's ``nonfinite`` names it with its value
(``{"advantage": "nan"}``), so a null never hides a NaN.

Token truth: ``prompt`` is the prompt exactly as the model saw it, its token ids decoded with
the special tokens kept (the chat template, the tools' description, the environment's
``reset()`` text), and ``segments`` cuts the ids the trainer scored (the prompt's, then the
completion's) into runs by who wrote them: ``{"role", "loss_mask", "ids", "text"}`` with
role ``prompt``, ``model``, ``tool`` or ``environment`` (a run appended after a model turn
holds the chat template's glue and the next generation prompt too), ``loss_mask`` 1 where
the loss covers the run (the model's tokens), 0 where it does not, and ``text`` the run's
ids decoded, special tokens kept. Their ids joined are the row's prompt and completion ids,
token for token; ``portarl episodes`` prints them (:mod:`portarl.cli.episodes`). A single
turn has two segments, the prompt and the model's completion.

Multi-turn episodes (tools, environments) add the whole ``conversation`` after the prompt,
message by message (the model's turns, tool calls, tool results and observations, each
with the tokens it took; several results appended together: the first counts them all),
``unread`` (what came after the model's last turn and was never appended, so the model
never read it: the environment's final observation or error, results past the token
budget), its ``turns``, and the episode's finish reason (:mod:`portarl.multiturn.episode`);
``completion`` is the final model turn.

Size: a row with its segments is two to four times one without (each token's id, up to 8
characters with a 150k vocabulary, and the segments' text, which repeats the prompt and the
conversation: ``"".join`` of it is the whole sequence); there are ``logging.samples_count``
rows every ``logging.samples_every`` steps (4 every 10 by default).
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


def exact_text(tokenizer):
    """``ids -> text`` with the special tokens kept: what the model read, as it read it."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)


def token_segments(prompt_ids, completion_ids, model_mask, layout, decode) -> list[dict]:
    """The prompt's and the completion's ids as runs by who wrote them (see the module
    docstring). ``layout``: ``[role, count]`` per run of the completion (a multi-turn
    episode's ``segments``); None: one model run (a single turn). ``model_mask``: per
    completion token, whether the loss covers it (None: every token)."""
    completion_ids = list(completion_ids)
    mask = [True] * len(completion_ids) if model_mask is None else [bool(m) for m in model_mask]
    if layout is None:
        layout = [["model", len(completion_ids)]] if completion_ids else []
    counted = sum(n for _, n in layout)
    if counted != len(completion_ids) or len(mask) != len(completion_ids):
        raise ValueError(f"the segments count {counted} tokens, the completion has {len(completion_ids)} "
                         f"and its mask {len(mask)}")
    segments = [_segment("prompt", list(prompt_ids), [False] * len(prompt_ids), decode)]
    at = 0
    for role, n in layout:
        segments.append(_segment(role, completion_ids[at: at + n], mask[at: at + n], decode))
        at += n
    return segments


def _segment(role: str, ids: list[int], mask: list[bool], decode) -> dict:
    loss = [int(m) for m in mask]
    uniform = len(set(loss)) <= 1
    return {"role": role, "loss_mask": (loss[0] if loss else 0) if uniform else loss, "ids": [int(i) for i in ids],
            "text": decode(ids)}


class SampleLog:
    def __init__(self, output_dir: str | Path, every: int, count: int, writer=None, echo: bool = True, decode=None,
                 trackers=None):
        """``decode``: ids -> text with the special tokens kept (:func:`exact_text`); the
        rows get their ``segments`` (and the prompt as the model saw it) when it is given
        and the samples carry their token ids. ``trackers``: the run's experiment trackers
        (:class:`portarl.trainer.run.trackers.fanout.Trackers`), each given the rows as a table."""
        self.path = Path(output_dir) / "samples.jsonl"
        self.every, self.count, self.writer, self.echo, self.decode = every, count, writer, echo, decode
        self.trackers = trackers

    def due(self, step: int) -> bool:
        return self.every > 0 and self.count > 0 and (step == 1 or step % self.every == 0)

    def write(self, step: int, samples: dict) -> list[dict]:
        """``samples``: ``prompts`` (text), ``completions``, ``finished``, ``rewards`` (name ->
        values), ``total``, ``advantages`` (or None), one entry per sample of this rank;
        optional: ``episodes`` (multi-turn records), ``prompt_ids``, ``completion_ids`` and
        ``model_mask`` (the scored ids, for the segments)."""
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
                row.update(conversation=episode["messages"], unread=episode["unread"], turns=episode["turns"],
                           finish_reason=episode["finish"])
            self._add_segments(row, samples, i, episode)
            rows.append(row)
        with self.path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        if rows and self.echo:
            r = rows[0]
            log.info("sample at step %d: prompt %r -> completion %r (rewards %s, finish %s)", step,
                     _tail(r["prompt"]), _short(r["completion"]), r["rewards"], r["finish_reason"])
        if self.writer is not None and rows:
            text = "\n\n".join(
                f"**prompt**: `{_md(r['prompt'])}`  \n**completion**: `{_md(r['completion'])}`  \n"
                f"rewards {r['rewards']}, advantage {r['advantage']}, finish {r['finish_reason']}" for r in rows)
            self.writer.add_text("samples", text, step)
        if self.trackers is not None and rows:
            self.trackers.samples(step, rows)
        return rows


    def _add_segments(self, row: dict, samples: dict, i: int, episode: dict | None) -> None:
        """``row["segments"]`` and the prompt as the model saw it, when the ids are known."""
        if self.decode is None or samples.get("prompt_ids") is None:
            return
        masks = samples.get("model_mask")
        try:
            segments = token_segments(samples["prompt_ids"][i], samples["completion_ids"][i],
                                      None if masks is None else masks[i],
                                      None if episode is None else episode["segments"], self.decode)
        except ValueError as err:  # a portarl bug: said loudly, the run goes on without the view
            log.error("samples.jsonl: no segments for sample %d at step %d: %s", i, row["step"], err)
            return
        row["prompt"] = segments[0]["text"]
        row["segments"] = segments


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


def _tail(text: str, limit: int = 160) -> str:
    """The end of a prompt: the question and the generation prompt (its start is often the
    chat template's system message)."""
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


def _md(text: str) -> str:
    return text.replace("`", "'").replace("\n", " ⏎ ")
