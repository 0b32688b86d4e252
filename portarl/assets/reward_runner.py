"""Running reward functions over a rollout: both forms, with every result checked.

A reward is a user's code; what it does wrong must stop the run with a message naming
the reward, the sample and its prompt, never become a silent 0, a silent exit or a
traceback from deep inside the trainer. Every call goes through a
:class:`~portarl.runtime.user_code.UserCodeGuard` (``RewardRunner.guard``: any ``BaseException``,
``sys.exit()`` included, and a call that outlives ``train.reward_timeout_s`` become a
:class:`RewardError`), and every value is checked: a number, and finite (a NaN or inf is
named with its sample at its first occurrence, instead of skipping steps until the
guards' streak stops the run, or a short run ends with exit 0). The trainer saves a
checkpoint of the last good step before it stops (see ``GRPOTrainer``).

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

Model-based rewards (a :class:`~portarl.trainer.config.RewardSpec` with ``model`` or
``judge``): a reward model (:mod:`portarl.assets.reward_models`) or a judge
(:mod:`portarl.assets.judges`), called once per batch with the prompts as in the data, the
completions as text and the rows' answers, through the same guard; a sample they cannot
score (:class:`~portarl.assets.reward_models.ScoreFailure`) is the same reward failure,
one line naming the reward, what failed (the judge's URL) and the sample. They are summed
with the functions by weight, and their values are in ``per_function`` and the metrics as
any function's.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch

from portarl.assets.data import Example
from portarl.assets.reward_models import ScoreFailure
from portarl.assets.rewards import resolve_reward
from portarl.runtime.user_code import UserCodeError, UserCodeGuard, arity_problem

#: ``train.reward_timeout_s``'s default: see :class:`portarl.trainer.config.TrainSection`.
DEFAULT_TIMEOUT_S = 300.0


class RewardError(UserCodeError):
    """A reward function failed; names the function, the sample index and its prompt."""


def reward_failure(name: str, index: int | None, prompt: str | None, problem: str) -> RewardError:
    """``reward 'name' <problem> on sample <index> (prompt '...')``."""
    return RewardError(f"reward {name!r}", _sample(index, prompt), problem)


def _sample(index: int | None, prompt: str | None) -> str | None:
    return None if index is None else f"sample {index} (prompt {prompt!r})"


def column_names(examples: list[Example]) -> list[str]:
    """Every column of ``examples`` (what a batched reward gets as keywords), first seen first."""
    return list(dict.fromkeys(k for ex in examples for k in ex.columns))


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
    #: "function", "model" (a reward model) or "judge"
    kind: str = field(default="function")

    def check_signature(self) -> None:
        """Refuse, before any step runs, a function that cannot take its form's arguments."""
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return
        if self.batched:
            try:
                sig.bind_partial([], [])  # columns are checked when it is called
            except TypeError as err:
                raise reward_failure(self.name, None, None, "has the wrong signature for fn(prompts, completions, "
                                     f"**columns): {err}") from None
            return
        problem = arity_problem(self.fn, ("prompt", "completion", "answer"), "prompt, completion, answer")
        if problem is not None:
            raise reward_failure(self.name, None, None, f"has the wrong signature for fn(prompt, completion, answer): "
                                 f"it {problem}")

    def check_columns(self, names) -> None:
        """A batched function must take the columns ``names`` as keyword arguments (a column
        it does not name needs ``**kwargs``; one it requires must be there). Checked before
        the model loads with every column of the data (:mod:`portarl.trainer.start.preflight`) and at
        each call with the batch's. Model-based rewards take no columns."""
        if self.kind != "function":
            return
        columns = {k: [] for k in names}
        try:
            inspect.signature(self.fn).bind([], [], **columns)
        except TypeError as err:
            raise reward_failure(self.name, None, None, f"cannot be called as fn(prompts, completions, "
                                 f"{', '.join(f'{k}=' for k in names)}): {err} (add **kwargs to accept every "
                                 "column)") from None
        except ValueError:  # no signature to check (a builtin): the call decides
            pass


@dataclass
class RewardScores:
    total: torch.Tensor                      # [N] weighted sum per sample
    per_function: dict[str, list]            # name -> N values (None where the function gave none)
    metrics: dict[str, float]


class RewardRunner:
    def __init__(self, specs, search_dirs=(), timeout_s: float | None = DEFAULT_TIMEOUT_S, *, device="cpu",
                 precision_dtype: str = "fp32", load: bool = True):
        """``specs``: :class:`~portarl.trainer.config.RewardSpec` s (``config.rewards``),
        ``(name_or_callable, weight)`` pairs or bare names / callables; ``timeout_s``: each
        call's time limit (``train.reward_timeout_s``; None: none); ``device`` /
        ``precision_dtype``: a reward model's defaults (the scoring process's device, the
        run's ``precision.dtype``); ``load=False``: check model-based rewards without
        loading a model (the preflight); ``load="lazy"``: checked now, loaded at the first
        score (async mode's trainer, where the worker scores: only ``eval.data`` makes the
        trainer score, and a reward model held twice would double its memory)."""
        self.guard = UserCodeGuard(timeout_s, "train.reward_timeout_s", error=RewardError)
        self.functions: list[RewardFunction] = []
        for i, item in enumerate(specs):
            kind = getattr(item, "kind", None)
            if kind in ("model", "judge"):
                self.functions.append(_model_based(item, f"rewards[{i}]", search_dirs, device, precision_dtype, load))
                continue
            if kind == "function":
                item = (item.name, item.weight)
            spec, weight = item if isinstance(item, tuple) else (item, 1.0)
            fn = resolve_reward(spec, search_dirs)
            name = getattr(fn, "__name__", str(spec)) if callable(spec) else str(spec)
            rf = RewardFunction(name, fn, float(weight), is_batched(fn))
            rf.check_signature()
            self.functions.append(rf)

    def close(self) -> None:
        """Stop and join the guard's watchdog thread (a later score starts a new one)."""
        self.guard.close()

    def reward_models(self) -> list:
        """The loaded reward models (:class:`~portarl.assets.reward_models.RewardModel`)."""
        models = [getattr(rf.fn, "loaded", rf.fn) for rf in self.functions if rf.kind == "model"]
        return [m for m in models if m is not None]

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def needs_answer(self) -> list[str]:
        return [f.name for f in self.functions if not f.batched]

    def score(self, examples: list[Example], completions: list[str]) -> RewardScores:
        """``examples[i]`` is sample i's row (repeated G times per group)."""
        return self.finish(examples, self.values(examples, completions))

    @property
    def has_judges(self) -> bool:
        return any(rf.kind == "judge" for rf in self.functions)

    def values(self, examples: list[Example], completions: list[str], skip_judges: bool = False) -> dict:
        """Each reward's values (``per_function``), on the calling thread, through the guard;
        ``skip_judges``: the judges are left to :meth:`judge_values`."""
        per_function = {}
        with self.guard.watching():  # the main thread's wake-up handler, once for the batch
            for rf in self.functions:
                if skip_judges and rf.kind == "judge":
                    continue
                run = self._model_based if rf.kind != "function" else self._batched if rf.batched else self._per_sample
                per_function[rf.name] = run(rf, examples, completions)
        return per_function

    def judge_values(self, examples: list[Example], completions: list[str]) -> dict:
        """The judges' values, callable from any thread (a judge is portarl's code, bounded by
        its own timeouts; the guard serves one thread): the async worker judges a batch
        while it generates the next. A failure is the same :class:`RewardError`."""
        return {rf.name: self._model_based(rf, examples, completions, _Direct())
                for rf in self.functions if rf.kind == "judge"}

    def finish(self, examples: list[Example], per_function: dict) -> RewardScores:
        """The weighted totals and ``reward/<name>`` metrics of every reward's values."""
        n = len(examples)
        per_function = {rf.name: per_function[rf.name] for rf in self.functions}  # the list's order
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
                raise reward_failure(", ".join(rf.name for rf in self.functions), i, examples[i].prompt_text,
                                     "gave no value (every reward function returned None for this sample)")
        return RewardScores(total, per_function, metrics)

    @staticmethod
    def _number(rf: RewardFunction, value, i: int, ex: Example, allow_none: bool):
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
                isinstance(value, torch.Tensor) and value.numel() == 1):
            kind = "None" if value is None else type(value).__name__
            raise reward_failure(rf.name, i, ex.prompt_text, f"returned {kind} ({value!r:.60}), expected a number"
                                 + (" or None" if allow_none else ""))
        number = float(value)
        if not math.isfinite(number):  # it would poison the group's advantages: named at its first occurrence
            raise reward_failure(rf.name, i, ex.prompt_text, f"returned {number}, expected a finite number")
        return number

    def _per_sample(self, rf: RewardFunction, examples, completions) -> list:
        out = []
        for i, (ex, text) in enumerate(zip(examples, completions)):
            if ex.answer is None:
                raise reward_failure(rf.name, i, ex.prompt_text, "needs the row's answer (it has the per-sample form "
                                     "fn(prompt, completion, answer)) but the row has no answer field; set "
                                     "data.answer_field or write it as fn(prompts, completions, **columns)")
            value = self.guard.call(rf.fn, (ex.prompt_text, text, ex.answer), what=f"reward {rf.name!r}",
                                    where=_sample(i, ex.prompt_text))
            out.append(self._number(rf, value, i, ex, allow_none=False))
        return out

    def _batched(self, rf: RewardFunction, examples, completions) -> list:
        prompts = [ex.prompt if isinstance(ex.prompt, str) else [dict(m) for m in ex.prompt] for ex in examples]
        comps = [text if isinstance(ex.prompt, str) else [{"role": "assistant", "content": text}]
                 for ex, text in zip(examples, completions)]
        names = column_names(examples)
        columns = {k: [ex.columns.get(k) for ex in examples] for k in names}
        rf.check_columns(names)
        values = self.guard.call(rf.fn, (prompts, comps), columns, what=f"reward {rf.name!r}",
                                 where=f"a batch of {len(prompts)} samples (first prompt {examples[0].prompt_text!r})")
        if isinstance(values, torch.Tensor):
            values = values.tolist()
        if not isinstance(values, (list, tuple)):
            raise reward_failure(rf.name, None, None, f"returned {type(values).__name__}, expected a list of "
                                 f"{len(prompts)} numbers or None")
        if len(values) != len(prompts):
            raise reward_failure(rf.name, None, None, f"returned {len(values)} values for {len(prompts)} samples")
        return [self._number(rf, v, i, ex, allow_none=True) for i, (v, ex) in enumerate(zip(values, examples))]


    def _model_based(self, rf: RewardFunction, examples, completions, guard=None) -> list:
        prompts = [ex.prompt if isinstance(ex.prompt, str) else [dict(m) for m in ex.prompt] for ex in examples]
        answers = [ex.answer for ex in examples]
        try:
            values = (guard or self.guard).call(rf.fn, (prompts, list(completions), answers), what=f"reward {rf.name!r}",
                                     where=f"a batch of {len(prompts)} samples (first prompt "
                                           f"{examples[0].prompt_text!r})")
        except RewardError as err:
            cause = err.__cause__
            if not isinstance(cause, ScoreFailure):
                raise
            i = cause.index
            raise reward_failure(rf.name, i, None if i is None else examples[i].prompt_text, cause.problem) from None
        if len(values) != len(prompts):
            raise reward_failure(rf.name, None, None, f"gave {len(values)} values for {len(prompts)} samples")
        return [self._number(rf, v, i, ex, allow_none=False) for i, (v, ex) in enumerate(zip(values, examples))]


def _model_based(spec, where: str, search_dirs, device, precision_dtype: str, load) -> RewardFunction:
    """A reward model or a judge, ready to score (``load=False``: checked, nothing loaded;
    ``"lazy"``: loaded at its first call)."""
    from portarl.assets.reward_models import RewardModel, read_model_config

    if spec.kind == "judge":
        from portarl.assets.judges import Judge

        fn = Judge(spec, where=where, search_dirs=search_dirs)  # no request is sent until a batch is scored
    elif load == "lazy":
        read_model_config(spec.model, where)
        fn = _Lazy(lambda: RewardModel(spec, where=where, device=device, precision_dtype=precision_dtype))
    elif load:
        fn = RewardModel(spec, where=where, device=device, precision_dtype=precision_dtype)
    else:
        read_model_config(spec.model, where)
        fn = None
    return RewardFunction(spec.name, fn, float(spec.weight), batched=True, kind=spec.kind)


class _Direct:
    """A guard stand-in that calls straight through; a failure is a :class:`RewardError`
    caused by it, as the guard's (for :meth:`RewardRunner.judge_values`)."""

    def call(self, fn, args=(), kwargs=None, *, what: str, where: str | None = None):
        try:
            return fn(*args, **(kwargs or {}))
        except Exception as err:  # noqa: BLE001  (named as the guard names it)
            raise RewardError(what, where, f"raised {type(err).__name__}: {err}") from err


class _Lazy:
    """A reward model built at its first call (``loaded``: None until then)."""

    def __init__(self, build):
        self.build, self.loaded = build, None

    def __call__(self, *args):
        if self.loaded is None:
            self.loaded = self.build()
        return self.loaded(*args)
