"""The asynchronous rollout worker: a process of its own that owns a copy of the policy,
samples the batches the trainer asks for and scores them (``rollout.mode: async``), with
``rollout.engine`` ``hf`` (the copy itself) or ``vllm`` (a vLLM engine in this process fed
from the copy: :func:`build_engine`).

Started by :class:`portarl.trainer.asynchronous.pipeline.AsyncRollout` as
``python -m portarl.rollout.async_worker SPEC.json``. It speaks JSON lines: requests on
stdin, replies on stdout (logging goes to stderr, which the trainer points at
``rollout_worker.log`` in the run directory). Nothing is unpickled: weights arrive as a
safetensors file, everything else as JSON (Python's ``json`` writes floats with
``repr``, which round-trips every float64, hence every fp32 log-prob, exactly).

Requests, handled strictly in order:

- ``{"op": "weights", "version": v, "path": p}``: load the weights the trainer published
  after optimizer step ``v`` (written atomically by the trainer) into the copy, and from
  it into the engine (vllm: in memory, vLLM's in-place reload); replies ``loaded``. Without
  ``path`` (``rollout.weight_sync: collective``) the version came over the weight-sync
  group (the spec's ``weight_sync``: the trainer's store), received whole by a thread
  while the worker may have been generating
  (:class:`~portarl.rollout.weight_sync.inbox.VersionInbox`); a torn version is refused
  and the worker keeps the version it loaded last.
- ``{"op": "generate", "step": s, "prompts": [[ids]], "examples": [...]}``: G samples per
  prompt with the weights loaded last. Seeds come from (run seed, step, prompt, sample)
  through :func:`portarl.rollout.request_seeds`, exactly as in colocated mode
  (:func:`portarl.trainer.phases.rollout.run_rollout`): the failure reported for other
  frameworks' async modes, identical completions step after step, came from a worker
  whose seeds never advanced. Rewards are computed here (the trainer gets scored
  batches); the reply carries the weight version that generated it. A batch with judges
  (``rewards: [{judge: URL}]``) is judged by a thread of its own (:class:`Deferred`) that
  replies when the judges have answered, while the worker goes on to the next request:
  judging batch s overlaps generating batch s + 1 (``rollout.max_staleness`` >= 1 sends
  it early). Replies keep the requests' order.
- ``{"op": "stop"}`` or the end of stdin: exit.

The worker dies with the trainer: ``PR_SET_PDEATHSIG`` (Linux) sends it SIGKILL when the
trainer dies, and a watchdog thread exits when its parent changes (other systems). It
ignores SIGINT and SIGTERM: the trainer decides when it stops (a scheduler's SIGTERM to
every process of a job must not kill the worker under a trainer that is finishing its
step and saving), and stops it with SIGKILL (it holds nothing worth saving), together with
every process it started: the worker is their subreaper, so what its tools and
environments start, however detached, stays in its process tree, which the trainer ends
whole (:func:`portarl.runtime.lifeline.stop_child`).

Fault injection for the tests (``PORTARL_ROLLOUT_WORKER_FAULT``): ``die@S``, ``hang@S``,
``garbage@S``, ``stale@S`` (the first batch of step S claims old weights: the trainer must
drop and regenerate it), all at the generate request of step S; ``constant_seed`` (one
seed for every sample: the identical-samples detector must fire). ``PORTARL_ROLLOUT_WORKER_DUMP``
names a directory where the worker saves its model's state dict after loading each
version (``v<version>.safetensors``; worker i > 0 of ``rollout.num_workers``: ``w<i>-v<version>``): the tests compare it with the trainer's, bitwise.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time

from portarl.runtime import blackbox
from portarl.runtime.lifeline import adopt_orphans, die_with_parent as _die_with_parent

FAULT_ENV = "PORTARL_ROLLOUT_WORKER_FAULT"
DUMP_ENV = "PORTARL_ROLLOUT_WORKER_DUMP"

log = logging.getLogger("portarl.rollout.worker")


def one_line(text: str, limit: int = 600) -> str:
    """An error for the trainer's one-line message (load_state_dict's, say, spans lines)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_fault(text: str | None) -> tuple[str | None, int | None]:
    if not text:
        return None, None
    kind, _, step = text.partition("@")
    return kind, int(step) if step else None


def build_engine(cfg, model, tokenizer, codec, work_dir: str):
    """The worker's rollout engine, sampling the worker's copy of the policy.

    ``hf`` samples ``model`` itself. ``vllm`` is a ``vllm.LLM`` of its own in this process
    (its engine core in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), started from
    ``model.path`` or a copy of ``model`` under ``work_dir``; each weight load goes into
    ``model`` first, then into vLLM through :meth:`~portarl.rollout.vllm.VLLMRollout.sync_weights`
    (vLLM's in-place ``reload_weights``). Everything else (seeds, rewards, the protocol) is
    the same for both engines: only this function and that one call know which runs.
    """
    if cfg.rollout.engine == "vllm":
        from portarl.rollout.vllm_build import engine_from_config, model_dir_for

        # Forced, not defaulted: an engine-core child process would outlive the SIGKILL that
        # stops this worker, and weight sync would copy every tensor across processes.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            log.info("rollout worker: VLLM_ENABLE_V1_MULTIPROCESSING set to 0 (vLLM runs in this process)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

        model_dir = model_dir_for(cfg, model, tokenizer, work_dir)
        return engine_from_config(cfg, model_dir, codec.stop_token_ids, next(model.parameters()).dtype)
    from portarl.rollout.hf import HFRollout

    engine = HFRollout(model, codec.eos_token_id, codec.pad_token_id, stop_token_ids=codec.stop_token_ids,
                       lean_decode=cfg.rollout.lean_decode, share_prefill=cfg.rollout.share_prefill)
    engine.record_routing = cfg.rollout.routing_replay == "rollout"  # an MoE model's experts, per token
    return engine


def held_frozen(model, version) -> set[str]:
    """The frozen parameters a version may leave out: none before the worker holds a whole
    version (the first carries them; :func:`portarl.trainer.asynchronous.weights.frozen_names`)."""
    if version is None:
        return set()
    from portarl.trainer.asynchronous.weights import frozen_names

    return frozen_names(model)


def check_version(model, missing, unexpected, version, path) -> None:
    """A version file must hold every tensor of the worker's model but tied twins and, once
    a whole version was loaded, the frozen parameters it then leaves out."""
    from portarl.trainer.asynchronous.weights import tied_twins

    absent = sorted(set(missing) - tied_twins(model) - held_frozen(model, version))
    if absent or unexpected:
        raise ValueError(f"weights file {path} does not match the worker's model: missing {absent[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")


class Worker:
    """The worker's state: model, codec, engine, rewards, and the weight version loaded."""

    def __init__(self, spec: dict):
        import torch

        from portarl.assets.models import build_model
        from portarl.multiturn.agent import make_agent
        from portarl.assets.reward_runner import RewardRunner
        from portarl.rollout import SamplingParams
        from portarl.assets.tokenizer import chat_template_option
        from portarl.vision.codec import codec_for
        from portarl.trainer.checkpoint import seed_global_rngs
        from portarl.trainer.config import TrainConfig
        from portarl.trainer.guards.precision import DTYPES

        torch.set_num_threads(int(spec["threads"]))
        self.config = cfg = TrainConfig.from_dict(spec["config"])
        self.device = torch.device(spec["device"])
        model, tokenizer = build_model(cfg.model, DTYPES[cfg.precision.dtype])
        self.model = model.to(self.device, dtype=DTYPES[cfg.precision.dtype])
        # As the trainer's model: train mode (the engine switches to eval while it samples)
        # and parameters that require grad. Frozen parameters take another CPU matmul path
        # under inference_mode, and the log-probs then move in the last bits.
        self.model.train()
        d = cfg.data
        self.codec = codec_for(tokenizer, self.model, chat_template=chat_template_option(d.chat_template),
                              system_prompt=d.system_prompt)
        # tools / environment: the episodes, and so the tools, run here (portarl.multiturn)
        self.agent = make_agent(cfg, self.codec, spec["search_dirs"])
        self.engine = build_engine(cfg, self.model, tokenizer, self.codec, spec["work_dir"])
        seed_global_rngs(cfg.train.seed)  # the rewards run here: user code's randomness, as in the trainer
        # reward models load here, on the worker's device unless their own device is named
        self.rewards = RewardRunner(cfg.rewards, search_dirs=spec["search_dirs"], timeout_s=cfg.train.reward_timeout_s,
                                    device=self.device, precision_dtype=cfg.precision.dtype)
        r = cfg.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                       max_new_tokens=r.max_new_tokens)
        self.version: int | None = None
        self.inbox = None
        if spec.get("weight_sync"):  # rollout.weight_sync=collective: join the trainer's group now, before "ready"
            from portarl.rollout.weight_sync.inbox import VersionInbox

            sync = spec["weight_sync"]
            self.inbox = VersionInbox(sync["host"], int(sync["port"]), int(sync["rank"]), int(sync["world_size"]),
                                      float(sync["timeout_s"]), comm=sync.get("comm", "gloo"), device=self.device)
        self.partial = None
        if r.partial:  # partial rollouts: one pool of sequences in flight across steps (portarl.rollout.partial)
            from portarl.rollout.partial_schedule import PartialSchedule

            self.partial = PartialSchedule(cfg)
        self.index = int(spec.get("index", 0))  # its number among rollout.num_workers
        self.fault, self.fault_step = parse_fault(os.environ.get(FAULT_ENV))
        self.idle_since = time.perf_counter()
        self.cpu_mark = time.process_time()  # a batch's cpu_s: this process's CPU since the last batch

    def load_weights(self, version: int, path: str | None) -> dict:
        if path is not None:
            from safetensors.torch import load_model

            missing, unexpected = load_model(self.model, path, strict=False, device=str(self.device))
            check_version(self.model, missing, unexpected, self.version, path)
        elif self.inbox is None:
            raise RuntimeError(f"weights version {version} came without a file, and this worker has no weight-sync group")
        else:
            from portarl.rollout.weight_sync.inbox import load_version
            from portarl.trainer.asynchronous.weights import tied_twins

            try:
                tensors = self.inbox.take(version)
            except Exception as err:
                raise RuntimeError(f"{err}; the worker keeps weights version {self.version}") from None
            load_version(self.model, tensors, tied_twins(self.model) | held_frozen(self.model, self.version))
            del tensors
        self.engine.sync_weights(self.model)  # hf: a no-op (it samples self.model); vllm: into vLLM, in memory
        self.version = version
        if self.partial is not None:  # sequences in flight that would span too many versions: restarted or cut
            self.partial.pool.on_version(version)
        if os.environ.get(DUMP_ENV):
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                      os.path.join(os.environ[DUMP_ENV], f"{f'w{self.index}-' if self.index else ''}v{version}.safetensors"))
        return {"op": "loaded", "version": version}

    def generate(self, request: dict) -> dict:
        from portarl.assets.data import example_from_json
        from portarl.rollout import request_seeds
        from portarl.trainer.phases.episodes import play, reward_examples

        idle = time.perf_counter() - self.idle_since
        step, cfg = int(request["step"]), self.config
        g = cfg.rollout.group_size
        if self.version is None:
            raise RuntimeError(f"asked for step {step} before any weights were published")
        if self.fault_step == step and self.fault == "die":
            os._exit(3)
        if self.fault_step == step and self.fault == "hang":
            while True:
                time.sleep(60)
        blackbox.note(step=step, phase="rollout")  # the trainer names them if this process dies
        mode = "constant" if self.fault == "constant_seed" else cfg.rollout.seed_mode
        prompts = request["prompts"]
        seeds = request_seeds(cfg.train.seed, step, len(prompts), g, mode)
        examples = [example_from_json(e) for e in request["examples"]]
        started = time.perf_counter()
        if self.agent is None:
            media = {}
            if hasattr(self.codec, "batch_vision"):  # a vision-language model: its pixels and M-RoPE positions
                for ex, ids in zip(examples, prompts):
                    if self.codec.encode_example(ex) != list(ids):
                        raise RuntimeError(f"{ex.where}: the worker encodes this prompt to other tokens than the trainer")
                media = {"media": self.codec.batch_vision(examples, g)}
            batch = self.engine.generate([p for p in prompts for _ in range(g)], seeds, self.sampling, **media)
            texts = [self.codec.decode(c) for c in batch.completion_ids]
            rows, episode = [examples[i // g] for i in range(len(texts))], {}
        else:  # multi-turn episodes: the tools and environments run in this process (or its tool process)
            batch, texts, metrics, events = play(self.agent, self.engine, self.sampling, examples,
                                                 [p for p in prompts for _ in range(g)], seeds, g)
            rows = reward_examples(examples, g, batch, bool(self.agent.factories))
            episode = {"model_mask": batch.model_mask, "episodes": batch.episodes, "agent_metrics": metrics,
                       "agent_events": [list(e) for e in events]}
        gen_s = time.perf_counter() - started
        reply = {"op": "batch", "step": step, "version": self.version, "seeds": seeds, **episode}
        return self.scored_reply(reply, step, rows, texts, batch, gen_s, idle, started)

    def scored_reply(self, reply: dict, step: int, rows, texts, batch, gen_s: float, idle: float, started: float):
        """``reply`` with ``batch`` (its texts ``texts``, reward rows ``rows``) and its rewards:
        the reply itself, or a :class:`Deferred` one while judges answer."""
        blackbox.note(phase="scoring")
        judging = self.rewards.has_judges  # judged by a thread while this process takes the next request
        values = self.rewards.values(rows, texts, skip_judges=judging)
        reply.update({"prompt_ids": batch.prompt_ids, "completion_ids": batch.completion_ids,
                      "logprobs": batch.logprobs, "finished": batch.finished, "texts": texts, "gen_s": gen_s,
                      "idle_s": idle, "cpu_s": time.process_time() - self.cpu_mark})

        def scored(values: dict) -> dict:
            scores = self.rewards.finish(rows, values)
            reply.update(total=scores.total.tolist(), per_function=scores.per_function,
                         reward_metrics=scores.metrics, score_s=time.perf_counter() - started - gen_s)
            return reply
        self.cpu_mark = time.process_time()
        if getattr(batch, "routed_experts", None) is not None:  # MoE routing replay: every token fed's experts
            from portarl.moe.routing import experts_json

            reply["routed_experts"] = experts_json(batch.routed_experts)
        if self.fault_step == step and self.fault == "garbage":
            reply["completion_ids"] = reply["completion_ids"][:-1]
        if self.fault_step == step and self.fault == "stale":
            reply["version"] = self.version - 10
            self.fault = None
        if judging:
            return Deferred(lambda: scored({**values, **self.rewards.judge_values(rows, texts)}), step)
        return scored(values)

    def handle(self, request: dict) -> dict:
        op = request.get("op")
        try:
            if op == "weights":
                return self.load_weights(int(request["version"]), request.get("path"))
            if op == "generate" and self.partial is not None:  # into the pool; the batches owed that can go, go
                return _replied_one_by_one(op, self.partial.request(self, request))
            if op == "generate":
                reply = self.generate(request)
                self.idle_since = time.perf_counter()
                return reply
            if op in ("pool_state", "pool_restore") and self.partial is not None:
                return self.partial.state_reply() if op == "pool_state" else self.partial.restore(request["state"])
            return {"op": "error", "kind": "worker", "message": f"unknown request {op!r}"}
        except Exception as err:  # noqa: BLE001  (a reply: failed_reply says whose fault)
            return failed_reply(op, err)


def _replied_one_by_one(op: str, replies):
    """The replies of a request, each written as soon as it is made; an error raised while
    making one becomes its reply (as :meth:`Worker.handle` does for a single one)."""
    try:
        yield from replies
    except Exception as err:  # noqa: BLE001
        yield failed_reply(op, err)


def failed_reply(op: str, err: Exception) -> dict:
    """The error reply for a request that raised ``err``: a reward's (or an environment that
    failed every episode: user code, named) or the worker's (the trainer names it and stops)."""
    from portarl.runtime.user_code import UserCodeError

    if isinstance(err, UserCodeError):
        return {"op": "error", "kind": "reward", "message": one_line(str(err))}
    log.error("rollout worker: %s failed", op, exc_info=err)
    return {"op": "error", "kind": "worker", "message": one_line(f"{type(err).__name__}: {err}")}


class Deferred:
    """A batch whose judges are still answering: :meth:`start` finishes it on a thread of its
    own, which writes the reply (or the error) as soon as it is ready, while the worker reads
    and handles the next request (generates the next batch, loads weights). Replies keep
    the requests' order: the loop joins this thread before it writes any other reply."""

    def __init__(self, complete, step: int):
        self.complete, self.step = complete, step

    def start(self, write) -> threading.Thread:
        def run():
            try:
                reply = self.complete()
            except Exception as err:  # noqa: BLE001  (a reply, as handle's)
                reply = failed_reply("generate", err)
            try:
                write(reply)
            except (OSError, ValueError):  # the trainer closed the pipe (it stopped): nobody to tell
                pass

        thread = threading.Thread(target=run, name=f"portarl-judging-step-{self.step}")
        thread.start()
        return thread


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(int(os.environ.get("PORTARL_TRAINER_PID", os.getppid())))
    blackbox.attach_from_env()  # what it is doing, read by the trainer if it dies (client.WorkerClient)
    faulthandler.enable(all_threads=True)  # a crash's Python frames, into its log (stderr)
    adopt_orphans()  # what its tools and environments start stays in its tree, ended with it
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    # The protocol gets its own descriptor; fd 1 (and sys.stdout) become stderr, so stray
    # prints, from Python or from a C library, cannot corrupt the replies.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with open(argv[0]) as f:
        spec = json.load(f)
    worker = Worker(spec)
    code = 0
    pending = None  # the thread finishing a batch's judging (Deferred)
    try:
        out.write(json.dumps({"op": "ready", "pid": os.getpid()}) + "\n")
        out.flush()
        def write(reply: dict) -> None:
            out.write(json.dumps(reply) + "\n")
            out.flush()

        for line in sys.stdin:
            request = json.loads(line)
            if request.get("op") == "stop":
                break
            replies = worker.handle(request)  # partial rollouts: none, or the batches owed that are ready, one by one
            for reply in [replies] if isinstance(replies, (dict, Deferred)) else replies:
                if pending is not None:  # the batch before this one is replied to first
                    pending.join()
                    pending = None
                if isinstance(reply, Deferred):
                    pending = reply.start(write)
                else:
                    write(reply)
    finally:
        if pending is not None:  # its judges end within their timeouts
            pending.join()
        worker.rewards.close()  # the reward watchdog's thread
        worker.engine.close()  # vllm: its engine core and process-wide state; hf: nothing
        if worker.agent is not None:
            worker.agent.close()  # tool_isolation=process: its tool process
        if worker.inbox is not None:
            worker.inbox.close()  # before the trainer closes the group: it hosts the store
    if worker.inbox is not None:  # Gloo's threads must not race interpreter finalisation (portarl.runtime.exit_path)
        logging.shutdown()
        for stream in (out, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # the trainer closed the pipe: nothing more to say
                pass
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
