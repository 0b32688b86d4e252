"""Running reward functions over a rollout: both forms, with every result checked.

A reward is a user's code; what it does wrong must stop the run with a message naming
the reward, the sample and its prompt, never become a silent 0 or a traceback from deep
inside the trainer. :class:`RewardError` carries those; the trainer saves a checkpoint of
the last good step before it stops (see ``GRPOTrainer``).

Forms (decided once, from the signature):
- per sample ``fn(prompt, completion, answer) -> float``: called once per sample with the
  prompt as text (a conversation as ``role: content`` lines), the completion text, and the
  row's answer; it must return a number;
- batched ``fn(prompts, completions, **columns) -> list[float | None]`` (TRL's form; chosen
  when the first parameter is named ``prompts``): the prompts as in the data (string or
  message list), completions as text, or as ``[{"role": "assistant", "content": text}]``
  when the prompt is a conversation (as TRL passes them), and every other data column as a
  keyword argument holding one value per sample. ``None`` means "no reward from this
  function for this sample": the sample's total is the weighted sum of the others. A
  sample that gets no reward from any function is an error.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch

from portarl.data import Example
from portarl.rewards import resolve_reward


class RewardError(RuntimeError):
    """A reward function failed; names the function, the sample index and its prompt."""

    def __init__(self, name: str, index: int | None, prompt: str | None, problem: str):
        where = "" if index is None else f" on sample {index} (prompt {prompt!r})"
        super().__init__(f"reward {name!r} {problem}{where}")
        self.reward_name, self.index, self.prompt = name, index, prompt

    @classmethod
    def elsewhere(cls, message: str, rank: int) -> "RewardError":
        """This rank's copy of another rank's failure (the message as that rank raised it)."""
        err = cls.__new__(cls)
        RuntimeError.__init__(err, f"{message} (on rank {rank})")
        err.reward_name, err.index, err.prompt = None, None, None
        return err


def agree_on_failure(ctx, failure: RewardError | None) -> RewardError | None:
    """Under several ranks, a reward that fails on one rank must stop every rank: the stop
    saves a checkpoint, which is collective, so a rank that went on alone would hang its
    peers until the timeout. One flag reduction per step; on a failure the first failing
    rank's message reaches every rank (rank 0 writes the log)."""
    from portarl import distributed as pdist

    if not ctx.enabled or not pdist.any_rank(ctx, failure is not None):
        return failure
    import torch.distributed as dist

    messages: list = [None] * ctx.world_size
    dist.all_gather_object(messages, None if failure is None else str(failure), group=ctx.host_group)
    rank = next(r for r, m in enumerate(messages) if m is not None)
    return failure if failure is not None else RewardError.elsewhere(messages[rank], rank)


def is_batched(fn) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].name == "prompts"


@dataclass
class RewardFunction:
    name: str
    fn: object
    weight: float
    batched: bool = field(default=False)

    def check_signature(self) -> None:
        """Refuse, before any step runs, a function that cannot take its form's arguments."""
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return
        try:
            if self.batched:
                sig.bind_partial([], [])  # columns are checked when it is called
            else:
                sig.bind("prompt", "completion", "answer")
        except TypeError as err:
            form = "fn(prompts, completions, **columns)" if self.batched else "fn(prompt, completion, answer)"
            raise RewardError(self.name, None, None, f"has the wrong signature for {form}: {err}") from None


@dataclass
class RewardScores:
    total: torch.Tensor                      # [N] weighted sum per sample
    per_function: dict[str, list]            # name -> N values (None where the function gave none)
    metrics: dict[str, float]


class RewardRunner:
    def __init__(self, specs, search_dirs=()):
        """``specs``: ``(name_or_callable, weight)`` pairs or bare names / callables."""
        self.functions: list[RewardFunction] = []
        for item in specs:
            spec, weight = item if isinstance(item, tuple) else (item, 1.0)
            fn = resolve_reward(spec, search_dirs)
            name = getattr(fn, "__name__", str(spec)) if callable(spec) else str(spec)
            rf = RewardFunction(name, fn, float(weight), is_batched(fn))
            rf.check_signature()
            self.functions.append(rf)

    @property
    def needs_answer(self) -> list[str]:
        return [f.name for f in self.functions if not f.batched]

    def score(self, examples: list[Example], completions: list[str]) -> RewardScores:
        """``examples[i]`` is sample i's row (repeated G times per group)."""
        n = len(completions)
        per_function = {}
        for rf in self.functions:
            values = self._batched(rf, examples, completions) if rf.batched else self._per_sample(rf, examples, completions)
            per_function[rf.name] = values
        total = torch.zeros(n, dtype=torch.float32)
        metrics = {}
        for rf in self.functions:
            values = per_function[rf.name]
            given = [v for v in values if v is not None]
            if given:
                metrics[f"reward/{rf.name}"] = sum(given) / len(given)
            total += torch.tensor([rf.weight * v if v is not None else 0.0 for v in values], dtype=torch.float32)
        for i in range(n):
            if all(per_function[rf.name][i] is None for rf in self.functions):
                raise RewardError(", ".join(rf.name for rf in self.functions), i, examples[i].prompt_text,
                                  "gave no value (every reward function returned None for this sample)")
        return RewardScores(total, per_function, metrics)

    @staticmethod
    def _number(rf: RewardFunction, value, i: int, ex: Example, allow_none: bool):
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
                isinstance(value, torch.Tensor) and value.numel() == 1):
            kind = "None" if value is None else type(value).__name__
            raise RewardError(rf.name, i, ex.prompt_text, f"returned {kind} ({value!r:.60}), expected a number"
                              + (" or None" if allow_none else ""))
        return float(value)

    def _per_sample(self, rf: RewardFunction, examples, completions) -> list:
        out = []
        for i, (ex, text) in enumerate(zip(examples, completions)):
            if ex.answer is None:
                raise RewardError(rf.name, i, ex.prompt_text, "needs the row's answer (it has the per-sample form "
                                  "fn(prompt, completion, answer)) but the row has no answer field; set "
                                  "data.answer_field or write it as fn(prompts, completions, **columns)")
            try:
                value = rf.fn(ex.prompt_text, text, ex.answer)
            except Exception as err:
                raise RewardError(rf.name, i, ex.prompt_text, f"raised {type(err).__name__}: {err}") from err
            out.append(self._number(rf, value, i, ex, allow_none=False))
        return out

    def _batched(self, rf: RewardFunction, examples, completions) -> list:
        prompts = [ex.prompt if isinstance(ex.prompt, str) else [dict(m) for m in ex.prompt] for ex in examples]
        comps = [text if isinstance(ex.prompt, str) else [{"role": "assistant", "content": text}]
                 for ex, text in zip(examples, completions)]
        names = []
        for ex in examples:
            names += [k for k in ex.columns if k not in names]
        columns = {k: [ex.columns.get(k) for ex in examples] for k in names}
        try:
            inspect.signature(rf.fn).bind(prompts, comps, **columns)
        except TypeError as err:
            raise RewardError(rf.name, None, None, f"cannot be called as fn(prompts, completions, "
                              f"{', '.join(f'{k}=' for k in names)}): {err} (add **kwargs to accept every column)") from None
        except ValueError:  # no signature to check (a builtin): the call decides
            pass
        try:
            values = rf.fn(prompts, comps, **columns)
        except Exception as err:
            raise RewardError(rf.name, None, None, f"raised {type(err).__name__}: {err} (on a batch of "
                              f"{len(prompts)} samples; first prompt {examples[0].prompt_text!r})") from err
        if isinstance(values, torch.Tensor):
            values = values.tolist()
        if not isinstance(values, (list, tuple)):
            raise RewardError(rf.name, None, None, f"returned {type(values).__name__}, expected a list of "
                              f"{len(prompts)} numbers or None")
        if len(values) != len(prompts):
            raise RewardError(rf.name, None, None, f"returned {len(values)} values for {len(prompts)} samples")
        return [self._number(rf, v, i, ex, allow_none=True) for i, (v, ex) in enumerate(zip(values, examples))]


def finite_or_none(value) -> float | None:
    """A JSON-safe value for samples.jsonl."""
    return None if value is None or not math.isfinite(value) else float(value)
