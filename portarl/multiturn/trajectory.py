"""An episode's tokens: exactly the ids the engine produced, plus the ids appended after
them (tool results, observations, the next generation prompt), never re-tokenised from text.

Per token after the prompt: the id, whether the model produced it (``model_mask``: the
loss covers these only; appended tokens are context the model reads, not actions it took)
and the behaviour log-prob (the engine's, for model tokens; 0.0 for appended ones, which
have none and which every consumer masks out).

``segments``: who wrote the ids after the prompt, run by run, ``[role, count]`` in order
(``model`` for a model turn, ``tool`` for tool results, ``environment`` for an observation;
an appended run includes the chat template's glue around it and the next generation
prompt). The sample log cuts the trained ids at these counts (``samples.jsonl``'s
``segments``, ``portarl episodes``), so what a person reads is exactly what was scored.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Trajectory:
    prompt_ids: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)
    model_mask: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    segments: list[list] = dataclasses.field(default_factory=list)  # [role, count] per run of ids

    def add_model(self, ids: list[int], logprobs: list[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} model tokens but {len(logprobs)} log-probs")
        self.ids += ids
        self.model_mask += [True] * len(ids)
        self.logprobs += [float(v) for v in logprobs]
        self._segment("model", len(ids))

    def add_context(self, ids: list[int], role: str) -> None:
        """Appended ids (``role``: ``tool`` or ``environment``): read by the model, not trained."""
        self.ids += ids
        self.model_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self._segment(role, len(ids))

    def _segment(self, role: str, count: int) -> None:
        if count:
            self.segments.append([role, count])

    def context(self) -> list[int]:
        """What the next turn is generated from: the prompt and everything since."""
        return self.prompt_ids + self.ids

    @property
    def model_tokens(self) -> int:
        return sum(self.model_mask)


def model_only(rows: list[list], masks: list[list[bool]] | None) -> list[list]:
    """Each row's entries at model tokens (every entry when ``masks`` is None: single turn)."""
    if masks is None:
        return rows
    return [[v for v, m in zip(row, mask) if m] for row, mask in zip(rows, masks)]


__all__ = ["Trajectory", "model_only"]
