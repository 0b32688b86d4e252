"""Generative judges: ``rewards: [{judge: URL, model: NAME, prompt: FILE, parse: ..., concurrency,
rate_limit, timeout_s, retries, name, weight}]``, scored by an OpenAI-compatible chat
completions server (a local ``vllm serve``, vllm-ascend's, or any endpoint): verl's GenRM,
OpenRLHF's ``--reward.remote_url``.

Contract:

- Endpoint: ``POST {URL}/v1/chat/completions``; a URL ending in ``/v1`` gets
  ``/chat/completions``, one ending in ``/chat/completions`` is used as given. Body:
  ``{"model": NAME, "messages": [{"role": "user", "content": TEXT}], "temperature": 0}``
  (and ``max_tokens`` when set);
  ``$PORTARL_JUDGE_API_KEY``, when set, is sent as ``Authorization: Bearer``. The score is
  read from ``choices[0].message.content``.
- TEXT is the ``prompt`` file (default :data:`DEFAULT_TEMPLATE`) with ``{prompt}`` (the
  prompt's text; a conversation as ``role: content`` lines), ``{completion}`` and
  ``{answer}`` replaced; no other braces are touched, so a template may hold JSON.
- ``parse``: ``number`` / ``first_number`` (the first number in the reply), ``last_number``,
  or ``module:function`` (``fn(reply_text) -> float``, found as reward functions are). The
  score must be a finite number.
- Each process sends at most ``concurrency`` requests at once and starts at most
  ``rate_limit`` per second (under torchrun every rank calls the judge for its own samples:
  both limits are per rank). A request that fails to connect, times out (``timeout_s``, on
  connecting and on each read), or gets HTTP 429 / 5xx is tried again up to ``retries``
  times, after ``0.5 s x 2^attempt x (1 + U[0, 1))`` (exponential backoff with jitter, from
  a generator of its own: the run's seeded global generators are not drawn from). Any
  other HTTP error, a reply that is not a chat completion, or one with no score is not
  retried (a judge at temperature 0 answers the same nonsense again).
- A sample that cannot be scored raises :class:`ScoreFailure` naming the judge's URL and the
  problem; the runner turns it into the reward failure (a checkpoint of the last good step,
  one line naming the reward, the judge and the sample, exit 3). The first failure stops
  the others' retries; the batch's threads are joined before the error leaves, and each
  in-flight request ends within its timeout: nothing hangs, nothing is left running.
- In async mode (``rollout.mode: async``) the judge is called by the rollout worker, so
  judging batch t overlaps the trainer's update on batch t - 1, and, on a thread of the
  worker (:class:`portarl.rollout.async_worker.Deferred`, through
  :meth:`~portarl.assets.reward_runner.RewardRunner.judge_values`), its generating batch t + 1.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from portarl.assets.reward_models import ScoreFailure
from portarl.runtime.errors import ConfigError

DEFAULT_TEMPLATE = ("Rate how well the response answers the prompt, from 0 (wrong or useless) to 10 (correct and "
                    "helpful).\n\nPrompt:\n{prompt}\n\nResponse:\n{completion}\n\nReply with the number only.")
DEFAULTS = {"parse": "number", "concurrency": 4, "rate_limit": None, "timeout_s": 60.0, "retries": 2,
            "max_tokens": None}
BACKOFF_BASE_S = 0.5
API_KEY_ENV = "PORTARL_JUDGE_API_KEY"
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def endpoint(url: str) -> str:
    """The chat completions URL of ``url`` (module docstring)."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def first_number(text: str) -> float | None:
    found = _NUMBER.search(text)
    return float(found.group()) if found else None


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return float(found[-1]) if found else None


PARSERS = {"number": first_number, "first_number": first_number, "last_number": last_number}


class _Skipped(ScoreFailure):
    """Not asked: another sample's request failed first (never the error reported)."""


class _Retry(Exception):
    """A failure worth another try (connection, timeout, HTTP 429 / 5xx)."""


class RateLimiter:
    """At most ``per_second`` starts per second across the threads that share it; a wait
    ends early when ``stop`` is set."""

    def __init__(self, per_second: float | None, stop: threading.Event):
        self.interval = 1.0 / per_second if per_second else 0.0
        self.stop, self.lock, self.next = stop, threading.Lock(), 0.0

    def wait(self) -> None:
        if not self.interval:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next)
            self.next = start + self.interval
        self.stop.wait(max(0.0, start - now))


class Judge:
    """A judge, called as a batched reward ``fn(prompts, completions, answers)``."""

    def __init__(self, spec, *, where: str, search_dirs=()):
        from portarl.assets.rewards import resolve_reward

        self.url = endpoint(spec.judge)
        self.model = spec.model
        self.template = Path(spec.prompt).read_text() if spec.prompt else DEFAULT_TEMPLATE
        if "{completion}" not in self.template:
            raise ConfigError(f"{where}.prompt: {spec.prompt} does not contain {{completion}}: the judge would never "
                              "see the completion it scores")
        options = {k: getattr(spec, k) if getattr(spec, k) is not None else v for k, v in DEFAULTS.items()}
        self.parse_name = options["parse"]
        if self.parse_name in PARSERS:
            self.parse = PARSERS[self.parse_name]
        else:
            try:
                self.parse = resolve_reward(self.parse_name, search_dirs)
            except ValueError as err:
                raise ConfigError(f"{where}.parse: {str(err).replace('reward ', '', 1)}") from None
        self.concurrency, self.rate_limit = int(options["concurrency"]), options["rate_limit"]
        self.timeout_s, self.retries = float(options["timeout_s"]), int(options["retries"])
        self.max_tokens = options["max_tokens"]
        self.jitter = random.Random()  # not the run's seeded global generator

    def render(self, prompt, completion: str, answer) -> str:
        text = prompt if isinstance(prompt, str) else "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
        return (self.template.replace("{prompt}", text).replace("{answer}", "" if answer is None else str(answer))
                .replace("{completion}", completion))

    def __call__(self, prompts, completions, answers) -> list[float]:
        texts = [self.render(p, c, a) for p, c, a in zip(prompts, completions, answers)]
        stop = threading.Event()  # the first failure (or an exception here) ends the others' retries and waits
        limiter = RateLimiter(self.rate_limit, stop)
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(texts))),
                                  thread_name_prefix="portarl-judge")
        try:
            futures = [pool.submit(self.score_one, i, text, stop, limiter) for i, text in enumerate(texts)]
            scores, failures = [], []
            for future in futures:
                try:
                    scores.append(future.result())
                except ScoreFailure as err:
                    failures.append(err)
            if failures:  # the first real failure, not a sample that was skipped because of it
                raise next((e for e in failures if not isinstance(e, _Skipped)), failures[0])
            return scores
        finally:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)  # in-flight requests end within timeout_s

    def score_one(self, index: int, text: str, stop: threading.Event, limiter: RateLimiter) -> float:
        try:
            reply = self.ask(text, stop, limiter)
            return self.score(reply)
        except ScoreFailure as err:
            stop.set()
            raise type(err)(index, err.problem) from None

    def ask(self, text: str, stop: threading.Event, limiter: RateLimiter) -> str:
        """The judge's reply text, with retries (module docstring)."""
        problem = "was not asked"
        for attempt in range(self.retries + 1):
            if stop.is_set():
                raise _Skipped(None, f"judge {self.url}: not asked (another sample's request failed first)")
            limiter.wait()
            try:
                return self.post(text)
            except _Retry as err:
                problem = str(err)
            if attempt < self.retries:
                stop.wait(BACKOFF_BASE_S * 2 ** attempt * (1 + self.jitter.random()))
        tries = f"{self.retries + 1} tries" if self.retries else "1 try"
        raise ScoreFailure(None, f"judge {self.url} {problem} ({tries}; timeout_s {self.timeout_s:g})")

    def post(self, text: str) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "temperature": 0}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        headers = {"Content-Type": "application/json"}
        if os.environ.get(API_KEY_ENV):
            headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310  (the user's URL)
                raw = response.read()
        except urllib.error.HTTPError as err:
            if err.code == 429 or err.code >= 500:
                raise _Retry(f"answered HTTP {err.code}") from None
            raise ScoreFailure(None, f"judge {self.url} answered HTTP {err.code} ({_short(err.read())})") from None
        except (TimeoutError, socket.timeout):
            raise _Retry(f"did not answer within {self.timeout_s:g} s") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, (TimeoutError, socket.timeout)):
                raise _Retry(f"did not answer within {self.timeout_s:g} s") from None
            raise _Retry(f"is unreachable ({err.reason})") from None
        except (ConnectionError, OSError) as err:  # a connection reset or closed mid-reply
            raise _Retry(f"is unreachable ({err})") from None
        try:
            return json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ScoreFailure(None, f"judge {self.url} answered something that is not a chat completion "
                                     f"({_short(raw)})") from None

    def score(self, reply) -> float:
        if not isinstance(reply, str):
            raise ScoreFailure(None, f"judge {self.url} answered {type(reply).__name__} content, not text")
        try:
            value = self.parse(reply)
        except Exception as err:  # noqa: BLE001  (the user's parse function: named, one line)
            raise ScoreFailure(None, f"judge {self.url}: parse {self.parse_name!r} raised {type(err).__name__}: "
                                     f"{_short(str(err))} on the reply {_short(reply)}") from None
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ScoreFailure(None, f"judge {self.url} answered {_short(reply)}: no score in it (parse "
                                     f"{self.parse_name!r} gave {value!r:.40})")
        if not math.isfinite(float(value)):
            raise ScoreFailure(None, f"judge {self.url} answered {_short(reply)}: its score {value} is not finite")
        return float(value)


def _short(text, limit: int = 120) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = " ".join(str(text).split())
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")
