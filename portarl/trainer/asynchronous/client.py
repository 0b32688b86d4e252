"""The trainer's client of the asynchronous rollout worker (``rollout.mode: async``): the
process (:mod:`portarl.rollout.async_worker`), the reader thread of its replies, the JSON
line protocol, and the checks on every reply. Only the trainer's main rank runs one: the
schedule, the weights and how ranks share a batch are :mod:`portarl.trainer.asynchronous.pipeline`.

Faults are :class:`RolloutWorkerError`, one line naming the worker (pid and log): it exits,
sends nothing for ``rollout.timeout_s`` (hung), or replies with a malformed batch. The
worker runs in its own session (a Ctrl-C or a job-wide SIGTERM reaches the trainer only),
without torchrun's variables (it is not a rank), and dies with the trainer.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from portarl.runtime import blackbox
from portarl.runtime.distributed import without_torchrun_env
from portarl.runtime.lifeline import stop_child
from portarl.assets.reward_runner import RewardError, RewardScores
from portarl.rollout import RolloutBatch

#: Start-up (imports, model build) may take longer than a batch: the first ``ready`` gets
#: at least this long.
STARTUP_MIN_S = 300.0
WORKER_LOG = "rollout_worker.log"

log = logging.getLogger("portarl.train")


class RolloutWorkerError(RuntimeError):
    """The rollout worker died, hung or returned garbage; the message names it."""


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def reward_error(message: str) -> RewardError:
    """A :class:`RewardError` carrying ``message`` as it is (raised in the worker, or on
    another rank: the reward, sample and prompt are not known here)."""
    return RewardError.elsewhere(message)


class WorkerClient:
    """The worker process, its reader thread, and the protocol (requests out, replies in)."""

    def __init__(self, spec: dict, work_dir: Path, output_dir: Path, timeout_s: float, backend: str | None,
                 index: int = 0, env: dict[str, str] | None = None):
        """``index``: the worker's number with ``rollout.num_workers`` > 1 (its log is
        ``rollout_worker-<index>.log`` from worker 1 on); ``env``: variables set for the
        worker's process only (its visible device: ``rollout.worker_devices``)."""
        self.timeout_s, self.index = timeout_s, index
        self.log_path = Path(output_dir) / (WORKER_LOG if index == 0 else WORKER_LOG.replace(".log", f"-{index}.log"))
        self.replies: queue.Queue = queue.Queue()
        self.ready = False
        self.loaded = -1  # the newest weight version it said it loaded
        spec_path = Path(work_dir) / ("worker.json" if index == 0 else f"worker-{index}.json")
        spec_path.write_text(json.dumps(spec))
        self._log = self.log_path.open("a")
        # What it is doing (step, phase, the reward, tool or environment running), read if it dies.
        self.record = blackbox.create(Path(work_dir) / spec_path.name.replace(".json", ".blackbox"))
        env = {**without_torchrun_env(dict(os.environ)), "PORTARL_TRAINER_PID": str(os.getpid()),
               blackbox.ENV: str(self.record), **(env or {})}
        if backend is not None:
            from portarl.backends import BACKEND_ENV

            env[BACKEND_ENV] = backend
        self.started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "portarl.rollout.async_worker", str(spec_path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env, start_new_session=True)
        self.name = f"rollout worker{f' {index}' if index else ''} (pid {self.proc.pid}, log {self.log_path})"
        self.reader = threading.Thread(target=self._read, name="portarl-rollout-reader", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)  # end of output: the worker exited

    def send(self, message: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self._died("while being sent a request") from None

    def _died(self, when: str) -> RolloutWorkerError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        tail = ""
        try:
            lines = self.log_path.read_text().strip().splitlines()
            tail = f"; its last log line: {lines[-1].strip()!r}" if lines else ""
        except OSError:
            pass
        status = f"exited with code {code}" if code is not None else "closed its output"
        if code is not None and code < 0:
            status = f"was killed by {signal_name(-code)}"
        doing = blackbox.doing(blackbox.read(self.record))  # what it was doing: step, phase, the user code running
        return RolloutWorkerError(f"the {self.name} {status} {when}{',' + doing if doing else ''}{tail}")

    def exited(self, when: str) -> RolloutWorkerError | None:
        """The error naming the worker's exit, if it exited (``when``: what the trainer did).
        A worker that is exiting (its sockets closed first) gets a few seconds to be reaped."""
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None
        return self._died(when)

    def receive(self, waiting_for: str, limit: float | None = None) -> dict:
        """The next reply; ``limit`` seconds at most (``rollout.timeout_s`` by default)."""
        limit = self.timeout_s if limit is None else limit
        try:
            line = self.replies.get(timeout=limit)
        except queue.Empty:
            raise RolloutWorkerError(f"the {self.name} sent nothing for {limit:g} s while the trainer waited for "
                                     f"{waiting_for} (rollout.timeout_s={self.timeout_s:g}): hung or too slow; "
                                     "raise rollout.timeout_s if it is only slow") from None
        if line is None:
            raise self._died(f"while the trainer waited for {waiting_for}")
        try:
            reply = json.loads(line)
            if not isinstance(reply, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            raise RolloutWorkerError(f"the {self.name} replied with something that is not a message while the "
                                     f"trainer waited for {waiting_for}: {err} ({line[:80]!r})") from None
        if reply.get("op") == "error":
            if reply.get("kind") == "reward":
                raise reward_error(f"{reply['message']} (in the rollout worker)")
            raise RolloutWorkerError(f"the {self.name} failed while the trainer waited for {waiting_for}: "
                                     f"{reply.get('message')}")
        return reply

    def wait_ready(self) -> None:
        if not self.ready:
            reply = self.receive("its start-up", max(self.timeout_s, STARTUP_MIN_S))
            if reply.get("op") != "ready":
                raise RolloutWorkerError(f"the {self.name} sent {reply.get('op')!r} before 'ready'")
            self.ready = True
            log.info("%s ready after %.1f s", self.name, time.perf_counter() - self.started)

    def close(self) -> None:
        """Stop the worker and join it and the reader thread (every exit path); mid-batch or
        idle, its batches are not needed, nor kept."""
        try:
            stop_child(self.proc, self.reader)
        finally:
            self._log.close()


#: The reply's per-sample fields, in sample order (a rank's share is a slice of each).
SAMPLE_FIELDS = ("prompt_ids", "completion_ids", "logprobs", "finished", "texts", "seeds", "total")
#: Per-sample fields of multi-turn episodes (tools / environment), present only then.
EPISODE_FIELDS = ("model_mask", "episodes", "routed_experts")  # routed_experts: MoE routing replay


def _rows(reply: dict, key: str, n: int, name: str, step: int) -> list:
    rows = reply.get(key)
    if not isinstance(rows, list) or len(rows) != n:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise RolloutWorkerError(f"the {name} returned a malformed batch for step {step}: {key} has {got} rows, "
                                 f"expected {n}")
    return rows


def check_batch(reply: dict, step: int, n: int, name: str) -> None:
    """Raise RolloutWorkerError naming what is wrong with the reply, a batch of ``n`` samples."""
    def bad(why):
        return RolloutWorkerError(f"the {name} returned a malformed batch for step {step}: {why}")

    rows = {key: _rows(reply, key, n, name, step) for key in SAMPLE_FIELDS}
    for i, (c, lp) in enumerate(zip(rows["completion_ids"], rows["logprobs"])):
        if not isinstance(c, list) or not isinstance(lp, list) or len(c) != len(lp) or not c:
            raise bad(f"sample {i} has {len(c) if isinstance(c, list) else '?'} tokens and "
                      f"{len(lp) if isinstance(lp, list) else '?'} log-probs")
        if not all(isinstance(t, int) for t in c) or not all(isinstance(v, (int, float)) for v in lp):
            raise bad(f"sample {i} has a token that is not an integer or a log-prob that is not a number")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in rows["total"]):
        raise bad("a reward total is not a number")
    if "model_mask" in reply:  # multi-turn episodes: which tokens are the model's
        masks, episodes = _rows(reply, "model_mask", n, name, step), _rows(reply, "episodes", n, name, step)
        for i, (c, m) in enumerate(zip(rows["completion_ids"], masks)):
            if not isinstance(m, list) or len(m) != len(c) or not all(isinstance(v, bool) for v in m) or not any(m):
                raise bad(f"sample {i}'s model_mask is not one true / false per token (with at least one true)")
        if not all(isinstance(e, dict) for e in episodes) or not isinstance(reply.get("agent_metrics"), dict):
            raise bad("episodes or agent_metrics are malformed")
    per_function = reply.get("per_function")
    if not isinstance(per_function, dict) or any(not isinstance(v, list) or len(v) != n for v in per_function.values()):
        raise bad("per_function rewards do not have one value per sample")
    metrics = reply.get("reward_metrics")
    if not isinstance(metrics, dict) or not all(isinstance(v, (int, float)) for v in metrics.values()):
        raise bad("reward_metrics is not a mapping of numbers")
    for key in ("version", "gen_s", "score_s", "idle_s", "cpu_s"):
        if not isinstance(reply.get(key), (int, float)) or not math.isfinite(reply[key]):
            raise bad(f"{key} is missing or not a number")


def as_batch(reply: dict) -> tuple[RolloutBatch, RewardScores]:
    """A reply :func:`check_batch` passed (or a slice of one) as a RolloutBatch and RewardScores."""
    rollout = RolloutBatch(reply["prompt_ids"], reply["completion_ids"], reply["logprobs"],
                           [bool(f) for f in reply["finished"]], reply.get("model_mask"), reply.get("episodes"))
    if reply.get("routed_experts") is not None:  # MoE routing replay: the worker's recorded experts
        from portarl.moe.routing import experts_from_json

        rollout.routed_experts = experts_from_json(reply["routed_experts"])
    return rollout, RewardScores(torch.tensor(reply["total"], dtype=torch.float32), reply["per_function"],
                                 reply["reward_metrics"])


def validate_batch(reply: dict, step: int, n: int, name: str) -> tuple[RolloutBatch, RewardScores]:
    """The reply as a RolloutBatch and RewardScores, or RolloutWorkerError naming what is wrong."""
    check_batch(reply, step, n, name)
    return as_batch(reply)


def slice_reply(reply: dict, rows: slice) -> dict:
    """The reply restricted to the samples ``rows`` (whole groups of one rank)."""
    out = dict(reply)
    for key in SAMPLE_FIELDS + tuple(k for k in EPISODE_FIELDS if k in reply):
        out[key] = reply[key][rows]
    out["per_function"] = {name: values[rows] for name, values in reply["per_function"].items()}
    return out


__all__ = ["RolloutWorkerError", "STARTUP_MIN_S", "WORKER_LOG", "WorkerClient", "as_batch", "check_batch",
           "reward_error", "slice_reply", "validate_batch"]
